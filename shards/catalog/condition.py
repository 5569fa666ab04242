"""What a catalog record's set is now, besides the state its record keeps: the state ``list``,
``show``, the server and the viewer show, why, and what to do about it.

The record's own states are ``building``, ``ready``, ``failed`` and ``deleted``; a record says
more about its set than that, and the files at its location can change without the catalog:

  * ``abandoned``: building, but its builder is gone (its lease is dead; ``gc`` collects it);
  * ``replaced``: deleted because another build was forced into its location (``ingest build
    --force``; ``Catalog.claim``, ``Catalog.replace_at``): its files are gone;
  * ``changed``: ready, but ``manifest.json`` at its location is no longer the one registered
    (rebuilt there without this catalog, edited, or gone): the files there are not the set the
    record describes;
  * ``damaged``: ready, but its last verification found problems (``shard-service verify``, or the
    server's own re-hash of a shard that changed): its bytes are not all its manifest's;
  * otherwise the record's state.

Whether the manifest changed is decided by a ``stat`` of a local file against the stamp (size,
modification time) recorded when its bytes were last hashed; only a file that looks different is
read and hashed again (a touched file whose bytes are the same is not a change). Remote sets are
read and hashed (``remote=True``) or left unchecked. Nothing here writes to the catalog.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass

from ..format.manifest import MANIFEST_NAME, Manifest, describe
from ..io import storage
from .store import Record


@dataclass(frozen=True)
class Condition:
    state: str  # a record's state, or abandoned, replaced, changed, damaged (module docstring)
    problem: str | None = None  # why a set that was built is not ready to use, one sentence
    remedy: str | None = None  # what to do about it

    def sentence(self, rec: Record) -> str:
        """The condition in one line naming the set (for a refusal)."""
        return f"dataset {rec.id} ({rec.name or 'unnamed'}) is {self.state}: {self.problem}; {self.remedy}"


def recorded(rec: Record) -> str:
    """What the record says its set holds (``shards.format.manifest.describe``)."""
    return describe({name: s["clips"] for name, s in rec.splits.items()}, rec.options.get("clip", {}))


def file_stamp(url: str) -> tuple[int, int] | None:
    """A local file's (size, mtime_ns); None for a remote one. FileNotFoundError when it is gone."""
    path = storage.local_path(url)
    if path is None:
        return None
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def manifest_change(rec: Record, remote: bool = True) -> str | None:
    """Why ``manifest.json`` at a ready set's location is not the one registered, or None when it
    is (or is remote and ``remote`` is False)."""
    url = storage.join(rec.location, MANIFEST_NAME)
    try:
        stamp = file_stamp(url)
        if stamp is None and not remote:
            return None
        known = rec.verified_files.get(MANIFEST_NAME)
        if stamp is not None and known and tuple(known[:2]) == stamp and known[2] == rec.manifest_sha256:
            return None
        data = storage.read_bytes(url)
    except FileNotFoundError:
        return f"{url} is gone"
    return difference(rec, data)


def difference(rec: Record, data: bytes) -> str | None:
    """Why ``data``, read from a ready set's ``manifest.json``, is not its registered manifest, or
    None when it is."""
    if hashlib.sha256(data).hexdigest() == rec.manifest_sha256:
        return None
    try:
        now = Manifest.from_json(data).describe()
    except (ValueError, KeyError, TypeError):
        now = "something that is not a manifest this program reads"
    return (f"{storage.join(rec.location, MANIFEST_NAME)} changed since the set was registered: it describes "
            f"{now}, the record {recorded(rec)}")


def changed(rec: Record, problem: str) -> Condition:
    """The condition of a set whose manifest is not the registered one (``problem``: why)."""
    return Condition("changed", f"{problem}: the files there are not the registered set",
                     "rebuild it there (its ingest build command with --catalog and --force), or forget it "
                     f"(shard-service remove {rec.id[:12]})")


def condition(rec: Record, check_files: bool = True, remote: bool = True) -> Condition:
    """The set's condition (module docstring); ``check_files``: look at its manifest (a ``stat``,
    for a remote set a read unless ``remote`` is False)."""
    if rec.state == "building" and not rec.lease_alive():
        return Condition("abandoned", "its builder is gone",
                         "build it again (the finished work is resumed), or "
                         "`shard-service gc --yes` collects it")
    if rec.state == "deleted" and rec.replaced is not None:
        by = f"dataset {rec.replaced_by}" if rec.replaced_by else "a build without a catalog"
        return Condition("replaced",
                         f"{by} was forced into {rec.location} on {_day(rec.replaced)}, "
                         "so its files are gone",
                         "build it again (ingest build with its options and --force) to bring it back")
    if rec.state != "ready":
        return Condition(rec.state)
    change = manifest_change(rec, remote) if check_files else None
    if change:
        return changed(rec, change)
    if rec.verify_problems:
        return Condition("damaged",
                         f"its last verification ({_day(rec.verified)}) found {rec.verify_problems} "
                         f"problem{'s' if rec.verify_problems != 1 else ''}: {_first(rec.verify_detail)}",
                         "rebuild it (its ingest build command with --force) or repair its files, then "
                         f"shard-service verify {rec.id[:12]}")
    return Condition("ready")


def shown(rec: Record, cond: Condition) -> dict:
    """The record as ``show`` and the API give it, its state the condition's, with why and the remedy."""
    return {**rec.to_json(), "state": cond.state, "problem": cond.problem, "remedy": cond.remedy}


def _day(t: float | None) -> str:
    return "an unknown time" if t is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _first(detail: str | None, limit: int = 300) -> str:
    """The start of a verification's detail, short enough for one line."""
    detail = detail or "no detail recorded"
    return detail if len(detail) <= limit else detail[:limit].rsplit(" ", 1)[0] + " ..."
