"""The base under every wing of ``shards`` and every package of the project, importing nothing of
``shards`` itself: the refusals and their exit statuses (``errors``), the console-script framework
(``commands``: subcommands, argparse types, one line per refusal), progress lines (``progress``),
words and escapes for messages (``words``), sizes as written (``units``), and Pillow's block reuse
(``pillow_memory``)."""
