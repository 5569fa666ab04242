"""``shard-service`` console script: serve the dataset catalog over HTTP and manage it."""
from __future__ import annotations

import sys

from shards.base.commands import main as run_commands

COMMANDS = {"serve": "service.serve", "list": "service.admin:List", "show": "service.admin:Show",
            "tag": "service.admin:Tag", "untag": "service.admin:Untag", "verify": "service.admin:Verify",
            "remove": "service.admin:Remove", "gc": "service.admin:Collect"}


def main(argv: list[str] | None = None) -> int:
    return run_commands("shard-service", __doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
