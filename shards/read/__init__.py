"""shards.read: see docs/architecture.md."""
