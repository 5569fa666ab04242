"""``python ray_nodes.py ADDRESS N``: wait until the Ray cluster at ADDRESS lists N alive nodes
(at most 120 s; exit 1 if it never does). A test's hold point between ``ray start`` of a node, which
returns before the node has registered, and work that must see the node."""
from __future__ import annotations

import sys
import time

import ray


def main(address: str, nodes: int) -> int:
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    deadline = time.monotonic() + 120
    while (alive := sum(n["Alive"] for n in ray.nodes())) < nodes:
        if time.monotonic() > deadline:
            print(f"ray_nodes: {alive} of {nodes} nodes alive at {address} after 120 s", file=sys.stderr)
            return 1
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
