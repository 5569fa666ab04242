"""Forgetting sets and collecting failed builds: catalog changes plus the file deletions they ask for.

Only what a build writes is ever deleted from a set's location: ``manifest.json``,
``classes.txt``, ``errors.jsonl``, ``.staging/`` and the directories of the splits it built,
then the location itself if that left it empty. Anything else a user put there stays.
"""
from __future__ import annotations

import logging

from fsspec.core import url_to_fs

from shards.catalog import Catalog, CatalogError, Record
from shards.format.manifest import SET_FILES, STAGING_NAME
from shards.io import storage

log = logging.getLogger("service.housekeeping")


def purge(rec: Record) -> list[str]:
    """Delete the files a build of ``rec`` wrote; returns what was deleted."""
    removed = []
    for name in (*SET_FILES, STAGING_NAME, *rec.options.get("splits", [])):
        fs, path = url_to_fs(storage.join(rec.location, name))
        if fs.exists(path):
            fs.rm(path, recursive=True)
            removed.append(name)
    fs, root = url_to_fs(rec.location)
    try:
        if fs.exists(root) and not fs.ls(root):
            fs.rmdir(root)
    except OSError:
        pass
    log.info("dataset %s: deleted %s from %s", rec.id, ", ".join(removed) or "nothing", rec.location)
    return removed


def remove(catalog: Catalog, rec: Record, purge_files: bool) -> bool:
    """Forget a set (refused while tagged or being built); with ``purge_files`` delete its files."""
    catalog.mark_deleted(rec.id)
    if purge_files:
        purge(rec)
    return purge_files


def collectable(catalog: Catalog) -> list[Record]:
    """Failed builds and abandoned ones (their builder is gone), untagged."""
    return [r for r in catalog.list(("building", "failed"))
            if not r.tags and (r.state == "failed" or not r.lease_alive())]


def collect(catalog: Catalog) -> list[Record]:
    """Delete the files of every collectable build and forget it."""
    catalog.reap()
    done = []
    for rec in collectable(catalog):
        try:
            remove(catalog, rec, True)
        except CatalogError as e:  # claimed again meanwhile
            log.info("dataset %s: left alone (%s)", rec.id, e)
            continue
        done.append(rec)
    return done
