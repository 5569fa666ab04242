"""The one ``main`` behind every console script: subcommands, ``--help`` and logging.

A subcommand is anything with a docstring (its first line is the help), ``add_arguments(parser)``
and ``run(args) -> int``: a module, or a class used as a namespace. Commands are named by dotted
path (``"shards.tools.verify"``, ``"service.admin:List"``) and imported only when the CLI starts.

Exit status, the same for every command: 0 done; 1 the work failed (the message says why);
2 the command line asks for something that cannot be done (argparse's usage errors, and the
``shards.base.errors.UsageError`` a command raises: a value out of range, a path that does not
exist). A refusal (``shards.base.errors.CommandError``) is one line on stderr, never a traceback, and
stays one line whatever names it holds (``shards.base.words.printable``: a file name's line break or
escape code is shown escaped, as every console log record's arguments are).
Ctrl-C is one line too, status 130 (``Interrupted``, whose message a command may make say what
is kept). Output into a closed pipe (``shards stats | head``) ends quietly with status 141, as
``cat`` ends.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import signal
import sys

from .errors import CommandError, Interrupted, UsageError
from .progress import console_handler
from .units import parse_size
from .words import printable


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default after its help, once: not for on/off switches (``--no-flip`` is not
    "default: True"), not where the help already names its default or there is none; and the
    double backquotes of the docstrings that describe commands left out."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.default in (None, argparse.SUPPRESS, [], ()) or action.nargs == 0 or "default" in text
                or not action.option_strings):
            return text
        return text + (" " if text else "") + "(default: %(default)s)"

    def _format_text(self, text):
        return super()._format_text(text.replace("``", ""))

    def _fill_text(self, text, width, indent):
        """Paragraphs (split at blank lines) filled one by one; an indented one (a command line, an
        example) kept line for line, as written."""
        paragraphs = re.split(r"\n\s*\n", text.strip("\n"))
        return "\n\n".join(
            "\n".join(indent + line.rstrip() for line in p.splitlines()) if p[:1].isspace()
            else super(HelpFormatter, self)._fill_text(p, width, indent) for p in paragraphs)

    def _expand_help(self, action):
        return super()._expand_help(action).replace("``", "")


PACKAGES = ("shards", "ingest", "trainer", "service")  # this project's; the last three name their extras


def _load(target: str):
    module, _, attr = target.partition(":")
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError as e:
        package = module.split(".")[0]
        if package == "shards" or (e.name or "").split(".")[0] in PACKAGES:
            raise  # the base install holds everything these need: a bug
        return NotInstalled(e.name, package)
    return getattr(obj, attr) if attr else obj


class NotInstalled:
    """A command whose module needs a package of an extra that is not installed (the reading-only
    ``pip install kinetics-fast`` has none): listed, and answering whatever it is given, ``--help``
    included, with one line naming the extra."""

    def __init__(self, module: str, extra: str):
        self.__doc__ = f"(not installed: pip install 'kinetics-fast[{extra}]')"
        self.message = (f"needs the {extra} extra (the Python module {module!r} is not installed): "
                        f"pip install 'kinetics-fast[{extra}]'")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("given", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    def run(self, args: argparse.Namespace) -> int:
        raise UsageError(self.message)


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
                           formatter_class=HelpFormatter, add_help=not isinstance(command, NotInstalled),
                           **options)
        command.add_arguments(p)
    return parser, loaded


def main(prog: str, description: str, commands: dict[str, str], argv: list[str] | None = None) -> int:
    parser, loaded = build_parser(prog, description, commands)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not isinstance(loaded[args.command], NotInstalled):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        handlers=[console_handler()])  # never on a progress bar's line
    try:
        status = loaded[args.command].run(args)
        sys.stdout.flush()  # a closed pipe shows here rather than at exit
        return status
    except BrokenPipeError:
        return _reader_gone()
    except (CommandError, KeyboardInterrupt) as e:
        # a command that says what Ctrl-C leaves raises Interrupted
        refusal = Interrupted("interrupted") if isinstance(e, KeyboardInterrupt) else e
        print(f"{prog} {args.command}: error: {printable(refusal)}", file=sys.stderr)  # one line, always
        return refusal.status


def _reader_gone() -> int:
    """Output into a pipe whose reader has gone (``shards stats | head``): stop quietly with the
    status of a process SIGPIPE ended, as ``cat`` does. Standard output is pointed at /dev/null so
    that Python's flush at exit does not fail again (the Python docs' recipe, "Note on SIGPIPE")."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


# argparse ``type=`` checkers: a bad value is refused before any work starts, as argparse refuses
# a bad choice (``PROG COMMAND: error: argument --frames: ...``, exit status 2).

def int_in_range(lo: int, hi: int | None = None):
    """An integer in [lo, hi] (no upper bound when ``hi`` is None)."""
    return number_in_range(int, lo, hi)


def number_in_range(kind, lo: float, hi: float | None = None, *, above: bool = False):
    """A ``kind`` (int or float) in [lo, hi], or in (lo, hi] when ``above``; no upper bound when
    ``hi`` is None. The checker's ``in_range(value)`` checks a value instead of a flag's text
    (``ValueError``, the same message): configs built in Python refuse what the flag refuses."""
    def in_range(value):
        if not lo <= value or (above and value == lo) or (hi is not None and not value <= hi):  # NaN too
            wanted = (f"more than {lo}" if above else f"{lo} or more") if hi is None else f"{lo} to {hi}"
            raise ValueError(f"{value} is out of range: give {wanted}")
        return value

    def check(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        try:
            return in_range(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    check.__name__ = kind.__name__
    check.in_range = in_range
    return check


positive_int = int_in_range(1)


def byte_size(text: str) -> int:
    """'64MB', '1GiB', '200k', '4096' -> bytes, more than zero."""
    try:
        value = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 64MB, 1GiB, 200k, 4096)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give more than 0 bytes")
    return value


def count_or_share(text: str) -> str:
    """A count ('3') or a share in percent ('0.5%'), at least 0, as written (``share_of`` applies it)."""
    try:
        value = float(text[:-1]) if text.endswith("%") else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a count (3) or a share in percent (0.5%)") from None
    if not 0 <= value <= (100 if text.endswith("%") else value):
        raise argparse.ArgumentTypeError(
            f"{text!r} is out of range: give a count of 0 or more, or 0% to 100%")
    return text


def share_of(budget: str, total: int) -> int:
    """``count_or_share``'s text as a number of ``total`` things: the count, or the share rounded down."""
    return int(total * float(budget[:-1]) / 100) if budget.endswith("%") else int(budget)


def comma_list(choices):
    """A comma-separated list of some of ``choices``, in the order given, without repeats."""
    def check(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        unknown = [t for t in items if t not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"{', '.join(map(repr, unknown)) or 'nothing'}: choose from "
                                             f"{', '.join(choices)}")
        return list(dict.fromkeys(items))
    check.__name__ = "list"
    return check
