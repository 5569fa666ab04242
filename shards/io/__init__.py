"""shards.io: see docs/architecture.md."""
