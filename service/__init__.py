"""The dataset service: the catalog's shard sets served over HTTP to streaming trainers, and
the ``shard-service`` commands that manage the catalog. Uses ``shards`` and ``ingest``'s public API."""
