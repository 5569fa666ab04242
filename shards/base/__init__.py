"""shards.base: see docs/architecture.md."""
