"""The shard vocabulary shared by ingest, trainer and service.

A *shard set* is one split of a dataset stored as WebDataset tar shards plus one
``manifest.json`` per output directory. The manifest lists every shard (sample count,
bytes, SHA-256) and every sample's byte range inside its shard, so readers never list or
stat the filesystem. This package depends on no other package of the project.

Its wings, each importing only those beneath it (tests/test_layering.py): ``base`` (errors, the
command framework, progress, words, units) < ``io`` (storage, the range client) < ``format`` (the
bytes of a set) < ``plan`` (pure partitioning and layout) < ``read`` (samples, the node cache) <
``tools`` (the ``shards`` subcommands); ``catalog`` (the datasets built) stands on base, io and
format. docs/architecture.md draws them.
"""
