"""The dataset catalog: every shard set built, with leases and migrations, in a SQLite file (the
default) or a PostgreSQL database shared by service replicas.

  * ``store``: the ``Catalog`` and its records, all the SQL;
  * ``backends``: SQLite and PostgreSQL under that SQL (connections, write transactions, schema
    versions, the generation caches key on);
  * ``schema``: the schema as an ordered list of migrations, run by both;
  * ``ids``: a dataset's id, the SHA-256 of canonical JSON over its inputs and options.

The shard vocabulary around it (manifest, reading, partitioning) never needs it: only the
builds that register sets (``ingest.registry``) and the service that serves them do.
"""
from .backends import CatalogUnavailable
from .ids import canonical_json, dataset_id
from .store import HEARTBEAT_SECONDS, Catalog, CatalogError, Claim, Record, default_path, new_owner

__all__ = ["HEARTBEAT_SECONDS", "Catalog", "CatalogError", "CatalogUnavailable", "Claim", "Record",
           "canonical_json", "dataset_id", "default_path", "new_owner"]
