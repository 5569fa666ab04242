"""The one ``main`` behind every console script: subcommands, ``--help`` and logging.

A subcommand is anything with a docstring (its first line is the help), ``add_arguments(parser)``
and ``run(args) -> int``: a module, or a class used as a namespace. Commands are named by dotted
path (``"shards.verify"``, ``"service.admin:List"``) and imported only when the CLI starts.
"""
from __future__ import annotations

import argparse
import importlib
import logging


def _load(target: str):
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


def build_parser(prog: str, description: str, commands: dict[str, str],
                 **options) -> tuple[argparse.ArgumentParser, dict]:
    """The console script's parser and its loaded commands by name; ``options`` go to every
    ``ArgumentParser`` (tests pass ``exit_on_error=False``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, **options)
    sub = parser.add_subparsers(dest="command", required=True)
    loaded = {}
    for name, target in commands.items():
        command = loaded[name] = _load(target)
        p = sub.add_parser(name, help=command.__doc__.strip().splitlines()[0], description=command.__doc__,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter, **options)
        command.add_arguments(p)
    return parser, loaded


def main(prog: str, description: str, commands: dict[str, str], argv: list[str] | None = None) -> int:
    parser, loaded = build_parser(prog, description, commands)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    return loaded[args.command].run(args)
