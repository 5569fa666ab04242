"""Reading a set's samples: byte ranges of local files and URLs checked against the manifest
(``reading``), the node-local shard cache (``cache``), whole shards read directly (``direct``), and
the clip index of a set (``clipindex``)."""
