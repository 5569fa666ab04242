"""``ingest`` console script: ``ingest build`` and ``ingest synth``."""
from __future__ import annotations

import argparse
import logging
import sys

from . import build, synth

COMMANDS = {"build": build, "synth": synth}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ingest", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        p = sub.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.add_arguments(p)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
