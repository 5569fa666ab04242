"""Direct reads: a set that the dataset service serves, read from where it lies when this
machine can see it (a cluster's Lustre or GPFS mount), so the service hands out the catalog and
the manifest and the shard bytes come from the parallel filesystem.

A URL of the form ``http(s)://HOST/v1/datasets/REF`` names a set of the service. With ``auto``
the set's record is asked for (one GET); if its location is a local path that exists here and
its ``manifest.json`` hashes to the record's ``manifest_sha256`` (the very set the service
serves, byte for byte), the shards are read from that location; otherwise through the service,
as with ``never``. ``always`` fails, saying why, where a direct read is not possible. Either
way one log line says which path the set's shards take and how many there are.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re

from ..format.manifest import MANIFEST_NAME, Manifest
from ..io import storage
from ..io.http_range import DEFAULT_RETRY, Retry
from ..io.storage import local_path

log = logging.getLogger("shards.read.direct")
MODES = ("auto", "never", "always")
_SERVICE_SET = re.compile(r"https?://[^/]+(/[^/]+)*/v1/datasets/[^/]+")


class NoDirectRead(ValueError):
    """``always`` asked for, and the set cannot be read directly (the message says why)."""


def load_manifest(url: str, mode: str = "never", retry: Retry = DEFAULT_RETRY) -> Manifest:
    """``Manifest.load`` of the set at ``url``, its shards to be read directly as ``mode`` says; an
    HTTP source that is down is waited for as ``retry`` says."""
    return Manifest.load(url if url.rstrip("/").endswith(".json") else resolve(url, mode), retry)


def resolve(url: str, mode: str = "auto") -> str:
    """The directory URL to read the set at ``url`` from: ``url`` itself or, read directly, the
    set's location (``url`` without a trailing ``manifest.json``)."""
    if mode not in MODES:
        raise ValueError(f"direct reads {mode!r}: choose one of {', '.join(MODES)}")
    url = url.rstrip("/")
    if mode == "never":
        return url
    why = "it is not a set of the dataset service (http(s)://HOST/v1/datasets/REF)"
    if _SERVICE_SET.fullmatch(url):
        record = json.loads(storage.read_bytes(url))
        location, path = record["location"], local_path(record["location"])
        manifest = None if path is None else storage.join(path, MANIFEST_NAME)
        if path is None:
            why = f"its location {location} is not a filesystem path"
        elif not storage.exists(manifest):
            why = f"its location {location} is not visible here"
        elif hashlib.sha256(storage.read_bytes(manifest)).hexdigest() != record["manifest_sha256"]:
            why = f"{manifest} is not the manifest the service serves (its SHA-256 differs)"
        else:
            shards = sum(s["shards"] for s in record["splits"].values())
            log.info("%s: its %d shards are read directly from %s (the same manifest); "
                     "none through the service", url, shards, location)
            return location
    if mode == "always":
        raise NoDirectRead(f"{url}: cannot be read directly: {why}")
    log.info("%s: shards read through the service (no direct read: %s)", url, why)
    return url
