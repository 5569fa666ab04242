"""What ``ingest build``'s ``--out`` may hold, and what a build there may replace.

A build writes into a directory that is empty, or holds a set of ours (a finished one, with its
manifest, or a killed build's ``.staging``): ``prepare_out`` refuses anything else
(``ForeignFiles``) unless ``--force``. A finished set built with other options (those that decide
the bytes: ``byte_options``) is another set, which someone may be using: ``refuse_other_options``
keeps it (``ReplaceRefused``) unless ``--force``, naming the options that differ as flags. Once a
build is done, ``tidy`` leaves only the finished set. ``ingest.build`` runs the build around these;
``ingest.registry`` asks the same before it claims a catalog entry.
"""
from __future__ import annotations

import json
import os
import re

from fsspec.core import url_to_fs

from shards.base.errors import UsageError
from shards.base.words import plural
from shards.format.manifest import MANIFEST_NAME, STAGING_NAME, Manifest
from shards.io import storage

from .clips import ClipConfig
from .sources import SPLITS

_SHARD = re.compile(rf"({'|'.join(SPLITS)})/\1-\d{{6}}\.tar")  # packing.shard_name
# a manifest's config: what decides the bytes, beside "src" (where the inputs were) and
# "fingerprint" (how they were identified), which do not
BYTE_OPTIONS = ("layout", "clip", "shard_size", "shard_samples", "splits")


class ReplaceRefused(UsageError):
    """``--out`` holds a finished set that this build would replace, and ``--force`` was not given."""


class ForeignFiles(UsageError):
    """``--out`` holds files that no build of this project wrote, and ``--force`` was not given."""


def normalise(url: str) -> str:
    """Local paths absolute; URLs as given, without a trailing slash."""
    return url.rstrip("/") if "://" in url else os.path.abspath(url)


def byte_options(layout: str, cfg: ClipConfig, shard_size: int | None, shard_samples: int | None,
                 splits: list[str]) -> dict:
    """The options that decide a set's bytes, as its manifest's config records them."""
    return {"layout": layout, "clip": cfg.as_dict(), "shard_size": shard_size, "shard_samples": shard_samples,
            "splits": splits}


def refuse_other_options(out: str, options: dict, force: bool) -> Manifest | None:
    """The finished set at ``out``, if any; refused (``ReplaceRefused``) when it was built with
    other ``byte_options`` and ``force`` is not given."""
    found = existing(out)
    if found is None or force:
        return found
    old = {k: found.config.get(k) for k in BYTE_OPTIONS}
    if old != options:
        raise ReplaceRefused(f"--out {out} holds a shard set built with other options "
                             f"({_changes(old, options)}); --force replaces it, or choose another --out")
    return found


def prepare_out(out: str, force: bool) -> None:
    """Make a local ``out`` (refused in one line when it cannot be: a file, a path under one,
    ``/proc``), then refuse (``ForeignFiles``) one that holds files no build of this project
    wrote, naming one, unless ``force``: a build writes its shards, manifest and ledger under
    their usual names (another tool's ``val/val-000000.tar`` among them) and deletes shards its
    manifest does not list. What a build of ours leaves is taken: a finished set (its manifest),
    or a killed build's ``.staging``, which the rerun resumes."""
    local = storage.local_path(out)
    if local is not None:
        if os.path.exists(local) and not os.path.isdir(local):
            raise UsageError(f"--out {out}: not a directory (a file is there)")
        try:
            os.makedirs(local, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--out {out}: the directory cannot be created: {e.strerror}") from None
    if force or existing(out) is not None or storage.exists(storage.join(out, STAGING_NAME)):
        return
    fs, root = url_to_fs(out)
    root = root.rstrip("/")
    files = sorted(fs.find(root)) if fs.isdir(root) else []
    if files:
        raise ForeignFiles(f"--out {out} holds {plural(len(files), 'file')} no build of this project wrote "
                           f"(such as {files[0][len(root) + 1:]}): choose an empty or new directory, or "
                           "--force to build into it anyway (files named as a set's are then replaced)")


def _changes(old: dict, new: dict) -> str:
    """``--frames 4, now 8; ...``: the options that differ, named as flags."""
    a, b = _flat(old), _flat(new)
    return "; ".join(f"{_flag(k)} {_shown(a.get(k))}, now {_shown(b.get(k))}"
                     for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k))


def _flat(options: dict) -> dict:
    """``byte_options`` with the clip options beside the others."""
    return {**{k: v for k, v in options.items() if k != "clip"}, **(options.get("clip") or {})}


def _flag(option: str) -> str:
    return "the source layout" if option == "layout" else "--" + option.replace("_", "-")


def _shown(value) -> str:
    return "unset" if value is None else ",".join(value) if isinstance(value, list) else str(value)


def tidy(out: str, manifest: Manifest, keep_staging: bool) -> None:
    """Leave only the finished set: staging removed (unless kept), and no temporary file or shard
    of a killed or earlier build left beside the shards the manifest lists."""
    fs, root = url_to_fs(out)
    root = root.rstrip("/")
    if not keep_staging and fs.exists(f"{root}/{STAGING_NAME}"):
        fs.rm(f"{root}/{STAGING_NAME}", recursive=True)
    listed = {s.name for split in manifest.splits.values() for s in split.shards}
    for path in fs.find(root):
        rel = path.rstrip("/")[len(root) + 1:]
        if storage.TEMPORARY.search(rel) or (_SHARD.fullmatch(rel) and rel not in listed):
            fs.rm(path)


def existing(out: str) -> Manifest | None:
    if not storage.exists(storage.join(out, MANIFEST_NAME)):
        return None
    try:
        return Manifest.load(out)
    except (ValueError, KeyError, json.JSONDecodeError):
        return None
