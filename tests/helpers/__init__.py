"""tests.helpers: see docs/architecture.md."""
