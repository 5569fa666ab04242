"""Pure planning, functions of a few integers (and a set's labels), no I/O: which rank reads which
samples in what order (``partition``), whether node-affine epochs keep the class mix
(``classmix``), and the shard sizes a set should have (``layout``)."""
