"""Test helper: check command lines written in docs and container files against the real CLIs.

``project_commands(text)`` finds every ``ingest``/``shards``/``trainer``/``shard-service`` invocation in
shell text (also behind launchers such as ``horovodrun ... trainer train``), and ``parse(argv)``
parses one with the project's own argparse parsers, so a misspelt or removed flag fails.
"""
from __future__ import annotations

import argparse
import importlib
import re
import shlex

from shards.base.commands import build_parser

PROGRAMS = {"ingest": "ingest", "shards": "shards", "trainer": "trainer", "shard-service": "service",
            "service": "service"}  # console script or ``python -m`` name -> package


def parser(prog: str) -> argparse.ArgumentParser:
    """The console script ``prog``'s parser, built by the same function as its ``cli.main``'s."""
    cli = importlib.import_module(f"{PROGRAMS[prog]}.cli")
    return build_parser(prog, cli.__doc__, cli.COMMANDS, exit_on_error=False, allow_abbrev=False)[0]


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse ``[prog, subcommand, *args]``; AssertionError if the CLI rejects it."""
    prog = argv[0].rsplit("/", 1)[-1]
    try:
        return parser(prog).parse_args(argv[1:])
    except (SystemExit, argparse.ArgumentError) as e:
        raise AssertionError(f"rejected by {prog}'s parser ({e}): {' '.join(argv)}") from None


def logical_lines(text: str) -> list[str]:
    """Shell lines with backslash continuations joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.split(" #", 1)[0].strip() for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def project_commands(text: str) -> list[list[str]]:
    """Every project CLI invocation in ``text``: argv lists starting at the program name."""
    found = []
    for line in logical_lines(text):
        for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", line):
            try:
                words = shlex.split(part)
            except ValueError:
                continue
            for i, word in enumerate(words):
                name = word.rsplit("/", 1)[-1]
                if name in ("sh", "bash") and i + 2 < len(words) and words[i + 1] in ("-c", "-ec"):
                    found += project_commands(words[i + 2])  # a command run by a shell per rank
                    break
                if name in PROGRAMS and i + 1 < len(words) and not words[i + 1].startswith("-"):
                    found.append([name, *words[i + 1:]])
                    break
    return found
