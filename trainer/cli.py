"""``trainer`` console script: ``trainer train``, ``trainer elastic``, ``trainer test`` and ``trainer plot``."""
from __future__ import annotations

import sys

from shards.commands import main as run_commands

from .errors import ConfigError

COMMANDS = {"train": "trainer.train", "elastic": "trainer.elastic", "test": "trainer.evaluate",
            "plot": "trainer.plot"}


def main(argv: list[str] | None = None) -> int:
    try:
        return run_commands("trainer", __doc__, COMMANDS, argv)
    except ConfigError as e:  # a refusal: its one line and exit status 1, no traceback
        raise SystemExit(str(e)) from None


if __name__ == "__main__":
    sys.exit(main())
