"""ingest.tasks: see docs/architecture.md."""
