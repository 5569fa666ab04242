"""The shard format, on the base and ``io``: tar members (``tar``), a sample's members (``sample``),
per-sample digests (``digests``), the manifest and its checks (``manifest``, ``checks``), motion
fields and their colouring (``motionfield``, ``motioncolour``), cutting samples into shards
(``packing``) and the stored order (``ordering``). docs/shards.md describes the bytes."""
