"""A dataset's id: the SHA-256 of canonical JSON over its inputs, its byte-changing options
and the shard format version.

Canonical JSON: keys sorted, no insignificant whitespace, UTF-8, lists kept in the order
given (inputs are sorted here by path). The builder chooses what goes in: everything that
can change the output bytes, and nothing that cannot (worker counts, timeouts, the output
location), so the same data built twice anywhere gets the same id and is found again.
"""
from __future__ import annotations

import hashlib
import json

from ..format.manifest import FORMAT


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode()


def dataset_id(inputs: list[dict], options: dict, shard_format: str = FORMAT) -> str:
    """``inputs``: one dict per input file with at least ``path`` (plus e.g. size, mtime or a
    content hash, a label); ``options``: the options that change the output bytes."""
    body = {"format": shard_format, "inputs": sorted(inputs, key=lambda i: i["path"]), "options": options}
    return hashlib.sha256(canonical_json(body)).hexdigest()
