"""The catalog commands of ``shard-service``: list, show, tag, untag, verify, remove, gc.

Each class is one subcommand (a namespace for ``shards.base.commands``): its docstring is the help.
They work on the catalog file directly, so they need no running server.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from shards.base.errors import CommandError, NotFound
from shards.catalog import Catalog, Record, default_path
from shards.catalog.backends import is_url
from shards.catalog.condition import condition, shown
from shards.format.manifest import Manifest
from shards.tools.verify import set_file_stamps, verify

from . import housekeeping, states
from .files import checked_manifest


def _common(p: argparse.ArgumentParser, ref: bool = True) -> None:
    p.add_argument("--catalog", default=default_path(),
                   help="catalog file or postgresql:// URL ($SHARD_SERVICE_CATALOG)")
    if ref:
        p.add_argument("ref", help="id, unique id prefix, name or tag")


def refuse_missing(path: str, remedy: str = "`ingest build --catalog FILE` creates one") -> None:
    """A catalog file that does not exist, refused (opening it would create an empty one, and its
    directory); ``remedy``: what makes one. A URL is its server's to answer."""
    if not is_url(path) and not os.path.exists(path):
        raise NotFound(f"--catalog {path}: no such catalog ({remedy}; $SHARD_SERVICE_CATALOG names the "
                       "default)")


def _open(path: str) -> Catalog:
    """The catalog named; a file refused when there is none."""
    refuse_missing(path)
    return Catalog(path)


def _size(n: float) -> str:
    """Bytes for people: 512 B, 3.4 MB, 1.25 GB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.{2 if unit in ('TB', 'GB') else 1}f} {unit}"
    return f"{int(n)} B"


def _resolve(cat: Catalog, ref: str) -> Record:
    rec = cat.resolve(ref)
    if rec is None:
        gone = cat.replaced(ref)
        if gone is not None:
            raise NotFound(condition(gone).sentence(gone))
        raise NotFound(f"no dataset {ref!r} in {cat.where} (give an id, a unique id prefix, a name or a tag)")
    return rec


def _state(rec: Record) -> str:
    """The state ``list`` and ``gc`` show (``shards.catalog.condition``; local manifests checked by a
    stat)."""
    return condition(rec, remote=False).state


class List:
    """List the catalog's datasets: id, name, state, tags, clips, size, location. A state says what the set is
    now: changed (its manifest is not the registered one), damaged (its last verify found problems), replaced,
    abandoned; `show` says why and what to do. On a terminal each state is in its colour (service.states):
    only a sound set is green."""

    @staticmethod
    def add_arguments(p):
        _common(p, ref=False)
        p.add_argument("--all", action="store_true", help="include deleted sets")
        p.add_argument("--json", action="store_true", help="one JSON object per line")

    @staticmethod
    def run(args) -> int:
        kept = ("building", "ready", "failed", "deleted") if args.all else ("building", "ready", "failed")
        records = _open(args.catalog).list(kept)
        conditions = [condition(rec, remote=False) for rec in records]
        if args.json:
            for rec, cond in zip(records, conditions):
                print(json.dumps(shown(rec, cond), sort_keys=True))
            return 0
        print(f"{'id':<12}  {'name':<20} {'state':<9} {'clips':>9} {'size':>10}  tags / location")
        for rec, cond in zip(records, conditions):
            clips = sum(s["clips"] for s in rec.splits.values())
            size = sum(s["bytes"] for s in rec.splits.values())
            tags = f"[{', '.join(rec.tags)}] " if rec.tags else ""
            print(f"{rec.id[:12]}  {(rec.name or '-')[:20]:<20} {states.painted(cond.state, 9, sys.stdout)} "
                  f"{clips:>9,} {_size(size):>10}  {tags}{rec.location}")
        return 0


class Show:
    """Show one dataset's record (by id, unique id prefix, name or tag) as JSON, with its state now, why, and
    the remedy."""

    @staticmethod
    def add_arguments(p):
        _common(p)

    @staticmethod
    def run(args) -> int:
        rec = _resolve(_open(args.catalog), args.ref)
        print(json.dumps(shown(rec, condition(rec)), indent=2, sort_keys=True))
        return 0


class Tag:
    """Point a tag at a dataset (a tag names one set; tagging another moves it). Tagged sets are never
    gc'd."""

    @staticmethod
    def add_arguments(p):
        _common(p)
        p.add_argument("tag")

    @staticmethod
    def run(args) -> int:
        cat = _open(args.catalog)
        rec = _resolve(cat, args.ref)
        before = cat.tag(rec.id, args.tag)
        print(f"tagged {rec.id} {args.tag}" + (f" (moved from {before})" if before else ""))
        return 0


class Untag:
    """Remove a tag."""

    @staticmethod
    def add_arguments(p):
        _common(p, ref=False)
        p.add_argument("tag")

    @staticmethod
    def run(args) -> int:
        if not _open(args.catalog).untag(args.tag):
            raise NotFound(f"no tag {args.tag!r} in {args.catalog}")
        print(f"untagged {args.tag}")
        return 0


class Verify:
    """Re-hash a ready dataset against its manifest (and the manifest against the catalog); record the outcome
    and what each shard hashed to, which the server's ETags say from then on."""

    @staticmethod
    def add_arguments(p):
        _common(p)
        p.add_argument("--deep", action="store_true", help="also decode every JPEG")
        p.add_argument("--workers", type=int, default=4, help="shards checked at once")

    @staticmethod
    def run(args) -> int:
        cat = _open(args.catalog)
        rec = _resolve(cat, args.ref)
        if rec.state != "ready":
            raise CommandError(f"dataset {rec.id} is {rec.state}; only ready sets are verified")
        problems, hashed = [], {}
        try:
            checked_manifest(rec)  # the manifest is the registered one
            problems += [str(p) for p in verify(Manifest.load(rec.location), deep=args.deep,
                                                workers=args.workers, hashed=hashed)]
            small = set_file_stamps(rec.location, rec.files)  # classes.txt, errors.jsonl: the catalog's?
            problems += [f"{name}: SHA-256 differs from the catalog's" for name, (_, _, sha) in small.items()
                         if sha != rec.files[name][1]]
            hashed.update(small)
        except Exception as e:  # a missing or changed manifest is the outcome, not a crash
            problems.append(f"{rec.location}: {e}")
        for p in problems:
            print(p)
        detail = "; ".join(problems[:20]) + (f"; ... {len(problems) - 20} more" if len(problems) > 20 else "")
        cat.record_verify(rec.id, len(problems), detail or "ok", hashed)  # the server's ETags from now on
        count = f"{len(problems)} problem{'' if len(problems) == 1 else 's'}"
        print(f"{rec.id} at {rec.location}: {count} (recorded {time.strftime('%H:%M:%S')})")
        return 1 if problems else 0


class Remove:
    """Forget a dataset; its files are deleted only with --purge. Refused while tagged or being built."""

    @staticmethod
    def add_arguments(p):
        _common(p)
        p.add_argument("--purge", action="store_true", help="also delete the files the build wrote")

    @staticmethod
    def run(args) -> int:
        cat = _open(args.catalog)
        rec = _resolve(cat, args.ref)
        housekeeping.remove(cat, rec, args.purge)
        print(f"removed {rec.id}" + (f" and deleted its files at {rec.location}" if args.purge
                                     else f" (files kept at {rec.location})"))
        return 0


class Collect:
    """Delete failed and abandoned builds (files and record); a dry run unless --yes. Never a tagged set or a
    live build."""

    @staticmethod
    def add_arguments(p):
        _common(p, ref=False)
        p.add_argument("--yes", action="store_true", help="really delete (default: only say what would go)")

    @staticmethod
    def run(args) -> int:
        cat = _open(args.catalog)
        if not args.yes:
            found = housekeeping.collectable(cat)
            for rec in found:
                print(f"would remove {rec.id} ({_state(rec)}) and its files at {rec.location}")
            print("dry run: nothing deleted (--yes deletes)" if found else "nothing to collect")
            return 0
        done = housekeeping.collect(cat)
        for rec in done:
            print(f"removed {rec.id} and its files at {rec.location}")
        print(f"collected {len(done)} dataset{'' if len(done) == 1 else 's'}" if done
              else "nothing to collect")
        return 0
