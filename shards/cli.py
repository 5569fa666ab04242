"""``shards`` console script: plan, verify, stats and reshard shard sets."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> module in this package exposing add_arguments(parser) and run(args) -> int
COMMANDS = {"plan": "layout_cli", "verify": "verify", "stats": "stats", "reshard": "reshard"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shards", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, modname in COMMANDS.items():
        module = importlib.import_module(f"shards.{modname}")
        modules[name] = module
        p = sub.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.add_arguments(p)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    return modules[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
