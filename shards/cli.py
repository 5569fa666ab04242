"""``shards`` console script: plan, verify, stats, reshard and preview shard sets."""
from __future__ import annotations

import sys

from .commands import main as run_commands

COMMANDS = {"plan": "shards.layout_cli", "verify": "shards.verify", "stats": "shards.stats",
            "reshard": "shards.reshard", "preview": "shards.preview"}


def main(argv: list[str] | None = None) -> int:
    return run_commands("shards", __doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
