"""``trainer`` console script: ``trainer train``, ``trainer elastic``, ``trainer test`` and ``trainer plot``.

Each command's flags come from ``trainer.config`` (the standard library only) and its module, with
PyTorch, is imported only to run it, once the flags have become its configs: ``trainer train --help``,
a mistyped flag or flags that contradict each other (``--crop-size 128 --scale-size 64``, ``--arch tsm
--no-shift``) answer in a fraction of a second, not after the 2 s that importing PyTorch takes. A
refusal (``trainer.errors``, ``shards.base.errors``) is printed as every command prints one:
``trainer COMMAND: error: MESSAGE``, exit status 1 (2: the command line).
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys

from shards.base.commands import main as run_commands

from . import config


class Command:
    """A subcommand (``shards.base.commands``' protocol): ``configure`` (``trainer.config``'s, the
    standard library only) turns the parsed flags into the arguments of the module's ``main``,
    refusing what it cannot take, and only then is the module imported; its help is the module's
    docstring, read from the source."""

    def __init__(self, module: str, add_arguments, configure):
        self.module, self.add_arguments, self.configure = module, add_arguments, configure
        with open(importlib.util.find_spec(module).origin, encoding="utf-8") as f:
            self.__doc__ = ast.get_docstring(ast.parse(f.read()), clean=False)

    def run(self, args) -> int:
        arguments = self.configure(args)
        return importlib.import_module(self.module).main(*arguments)


TRAIN = Command("trainer.train", config.add_train_arguments, lambda args: (config.train_config(args),))
ELASTIC = Command("trainer.elastic", config.add_elastic_arguments,
                  lambda args: (config.train_config(args), config.elastic_config(args)))
TEST = Command("trainer.evaluate", config.add_evaluation_arguments,
               lambda args: (config.evaluation_config(args),))
PLOT = Command("trainer.plot", config.add_plot_arguments, lambda args: (args.runs, args.labels, args.out))
COMMANDS = {"train": "trainer.cli:TRAIN", "elastic": "trainer.cli:ELASTIC", "test": "trainer.cli:TEST",
            "plot": "trainer.cli:PLOT"}


# torch 2.13's oneDNN AVX2 convolution kernels corrupt the heap on AMD EPYC here for narrow networks
# (--width 4: "corrupted double-linked list" in backward, every run; AVX-capped: none in 8 runs; widths 8
# and 16 ran clean), so those, and `trainer test` (whose width is the checkpoint's), run oneDNN capped at
# AVX unless DNNL_MAX_CPU_ISA says otherwise. GPU training does not use these kernels.
ONEDNN_ISA = "AVX"
NARROW = 8  # widths below this get the cap


def _narrow(argv: list[str]) -> bool:
    """Whether the command line asks for a network narrower than ``NARROW`` (``--width N``)."""
    for i, word in enumerate(argv):
        value = word.split("=", 1)[1] if word.startswith("--width=") else (
            argv[i + 1] if word == "--width" and i + 1 < len(argv) else None)
        if value is not None and value.isdigit() and int(value) < NARROW:
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    if words[:1] == ["test"] or _narrow(words):
        # read when oneDNN first runs, after torch loads
        os.environ.setdefault("DNNL_MAX_CPU_ISA", ONEDNN_ISA)
    return run_commands("trainer", __doc__.split("\n", 1)[0], COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
