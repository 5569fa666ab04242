"""The suite's helpers, imported by the tests as ``helpers.X`` (tests/ is on the path): shard sets
and servers (``shardsets``), videos (``media``), nginx fronts (``fronts``), PostgreSQL
(``postgres``), runbook blocks (``runbooks``), the tools a test requires (``required``), strace
(``syscalls``), mutators (``mutations``, ``videofuzz``) and the command lines (``commandlines``),
and the launchers run as scripts (``faultrun``, ``holdpoint``, ``metadata_probe``, ``ray_nodes``),
which import their siblings by plain name from their own folder."""
