"""``shards`` console script: plan, verify, stats, reshard and preview shard sets."""
from __future__ import annotations

import sys

from .base.commands import main as run_commands

COMMANDS = {"plan": "shards.tools.layout_cli", "verify": "shards.tools.verify", "stats": "shards.tools.stats",
            "reshard": "shards.tools.reshard", "preview": "shards.tools.preview"}


def main(argv: list[str] | None = None) -> int:
    return run_commands("shards", __doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
