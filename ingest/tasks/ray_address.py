"""A Ray cluster's address checked before Ray is asked to join it (``ray.init`` would retry an
address where nothing listens for about ten minutes); imports no Ray."""
from __future__ import annotations

import re
import socket


def check_reachable(address: str) -> None:
    """Raise ConnectionError at once when nothing listens at a HOST:PORT address: ray.init would
    retry it for about ten minutes."""
    found = re.fullmatch(r"(?:ray://)?\[?([^\]/]+?)\]?:(\d+)", address)
    if found is None:  # 'auto' and other forms: Ray resolves them
        return
    try:
        socket.create_connection((found[1], int(found[2])), timeout=10).close()
    except OSError as e:
        raise ConnectionError(f"nothing answers at {address}: {e.strerror or e}") from None
