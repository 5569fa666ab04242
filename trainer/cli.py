"""``trainer`` console script: ``trainer train``, ``trainer elastic``, ``trainer test`` and ``trainer plot``.

Each command's flags come from ``trainer.config`` (the standard library only) and its module, with
PyTorch, is imported only to run it: ``trainer train --help`` or a mistyped flag answers in a
fraction of a second. A refusal (``trainer.errors``, ``shards.errors``) is printed as every
command prints one: ``trainer COMMAND: error: MESSAGE``, exit status 1 (2: the command line).
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys

from shards.commands import main as run_commands

from . import config


class Command:
    """A subcommand (``shards.commands``' protocol) whose module is imported only when it runs; its
    help is the module's docstring, read from the source."""

    def __init__(self, module: str, add_arguments):
        self.module, self.add_arguments = module, add_arguments
        with open(importlib.util.find_spec(module).origin, encoding="utf-8") as f:
            self.__doc__ = ast.get_docstring(ast.parse(f.read()), clean=False)

    def run(self, args) -> int:
        return importlib.import_module(self.module).run(args)


TRAIN = Command("trainer.train", config.add_train_arguments)
ELASTIC = Command("trainer.elastic", config.add_elastic_arguments)
TEST = Command("trainer.evaluate", config.add_evaluation_arguments)
PLOT = Command("trainer.plot", config.add_plot_arguments)
COMMANDS = {"train": "trainer.cli:TRAIN", "elastic": "trainer.cli:ELASTIC", "test": "trainer.cli:TEST",
            "plot": "trainer.cli:PLOT"}


# torch 2.13's oneDNN AVX2 convolution kernels corrupt the heap on AMD EPYC here for narrow networks
# (--width 4: "corrupted double-linked list" in backward, every run; AVX-capped: none in 8 runs), so CPU
# convolutions are capped at AVX unless DNNL_MAX_CPU_ISA says otherwise (GPU training does not use them).
ONEDNN_ISA = "AVX"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("DNNL_MAX_CPU_ISA", ONEDNN_ISA)  # read when oneDNN first runs, after torch loads
    return run_commands("trainer", __doc__.split("\n", 1)[0], COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
