"""shards.tools: see docs/architecture.md."""
