"""shards.format: see docs/architecture.md."""
