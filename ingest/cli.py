"""``ingest`` console script: ``ingest build`` and ``ingest synth``."""
from __future__ import annotations

import sys

from shards.base.commands import main as run_commands

COMMANDS = {"build": "ingest.build_cli", "synth": "ingest.synth"}


def main(argv: list[str] | None = None) -> int:
    return run_commands("ingest", __doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
