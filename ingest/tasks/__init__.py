"""Where a build's tasks run: the ``Tasks`` protocol and ``start`` (``runtime``), on Ray
(``ray_runtime``, ``ray_address``: joining a cluster) or in worker processes of this machine
(``local_runtime``). The tasks are the same functions on the same arguments either way; nothing
here knows what they do."""
