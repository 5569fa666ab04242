"""shards.plan: see docs/architecture.md."""
