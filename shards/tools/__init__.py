"""The ``shards`` subcommands (``shards.cli``): ``verify``, ``stats``, ``reshard``, ``preview`` and
``plan`` (``layout_cli``). They may use every wing of ``shards``; nothing but the CLI imports them,
except the helpers the builds share (``verify.stamps``)."""
