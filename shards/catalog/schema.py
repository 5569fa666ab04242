"""The catalog's schema as an ordered list of migrations, which both back ends run.

Migration k (counting from 1) takes a catalog whose schema version (SQLite's ``PRAGMA
user_version``, PostgreSQL's ``catalog_schema`` row) is k-1 to k. ``shards.catalog.store`` applies
the missing ones at open, all in one transaction, and refuses a catalog whose version is newer
than ``len(MIGRATIONS)``. The statements are SQLite's; ``shards.catalog.backends`` gives each to
PostgreSQL in its dialect (``REAL`` as ``DOUBLE PRECISION``), so write only SQL both accept.
Never edit a migration that has shipped: append a new one.
"""
from __future__ import annotations

MIGRATIONS: list[list[str]] = [
    # 1: datasets, their tags
    [
        """CREATE TABLE datasets (
            id TEXT PRIMARY KEY,               -- content fingerprint (SHA-256 hex)
            name TEXT,
            source TEXT NOT NULL,              -- the ingest input (path or fsspec URL)
            location TEXT NOT NULL,            -- where the shard set lives (path or fsspec URL)
            options TEXT NOT NULL,             -- JSON: the build options
            splits TEXT NOT NULL DEFAULT '{}', -- JSON: {split: {clips, bytes, shards, failed}}
            files TEXT NOT NULL DEFAULT '{}',  -- JSON: {manifest.json|classes.txt|errors.jsonl: [size, sha256]}
            manifest_sha256 TEXT,
            builder_version TEXT,
            state TEXT NOT NULL CHECK (state IN ('building', 'ready', 'failed', 'deleted')),
            created REAL NOT NULL,             -- Unix seconds
            finished REAL,
            owner TEXT,                        -- JSON {host, pid, token} of the process building it
            heartbeat REAL,                    -- last sign of life of that process
            attempts INTEGER NOT NULL DEFAULT 0,
            progress TEXT NOT NULL DEFAULT '{}',
            error TEXT,
            verified REAL,                     -- last `verify`: when, and its outcome
            verify_problems INTEGER,
            verify_detail TEXT
        )""",  # noqa: E501 -- SQLite keeps the schema's text as written: its comments stay unwrapped
        "CREATE UNIQUE INDEX datasets_live_name ON datasets(name) "
        "WHERE state != 'deleted' AND name IS NOT NULL",
        "CREATE INDEX datasets_location ON datasets(location)",
        """CREATE TABLE tags (
            tag TEXT PRIMARY KEY,
            dataset_id TEXT NOT NULL REFERENCES datasets(id) ON DELETE CASCADE
        )""",
        "CREATE INDEX tags_dataset ON tags(dataset_id)",
    ],
    # 2: what was last hashed of each local shard and how its file looked then (the server's ETags):
    #    JSON {shard name: [size, mtime_ns, sha256]}, written by a build and by `verify`
    [
        "ALTER TABLE datasets ADD COLUMN verified_files TEXT NOT NULL DEFAULT '{}'",
    ],
    # 3: a set another build was forced into the location of: its state is 'deleted' (its files are
    #    gone; its name and location are free), and these say by which set (an id, or '' for a build
    #    without a catalog) and when; shown as the state 'replaced' (shards.catalog.condition)
    [
        "ALTER TABLE datasets ADD COLUMN replaced_by TEXT",
        "ALTER TABLE datasets ADD COLUMN replaced REAL",
    ],
    # 4: a build asked for over HTTP keeps its request (JSON: src and options, as POST /v1/builds
    #    took it), so that when its builder dies any service replica can take it over and run it
    #    again from the same request (service.builds); NULL for builds started by `ingest build`
    [
        "ALTER TABLE datasets ADD COLUMN request TEXT",
    ],
]

SCHEMA_VERSION = len(MIGRATIONS)
