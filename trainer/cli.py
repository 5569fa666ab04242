"""``trainer`` console script: ``trainer train``, ``trainer test`` and ``trainer plot``."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> module in this package exposing add_arguments(parser) and run(args) -> int
COMMANDS = {"train": "train", "test": "evaluate", "plot": "plot"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, modname in COMMANDS.items():
        module = importlib.import_module(f"trainer.{modname}")
        modules[name] = module
        p = sub.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.add_arguments(p)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    return modules[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
