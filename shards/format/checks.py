"""A manifest's fields checked as it is loaded, before anything is read from what it names.

``Manifest.from_json`` hands the parsed JSON here, wherever it came from (a file, an fsspec URL,
the service, S3): a manifest is data from outside, and every reader trusts what passes. Checked:

* the shape: an object with the fields this build reads and no others, each of its type (a
  boolean is no number);
* the format version, one this build reads;
* the classes: a list of distinct strings;
* each split's name and each shard's name: a relative path inside the set, each part a plain name
  (letters, digits, ``._-``; no ``..``, no absolute path, no URL scheme, no backslash, no ``%``
  escape), no shard named twice;
* each shard's lists: as long as its ``num_samples``; keys distinct WebDataset keys; every sample
  range whole tar blocks, at least a header, at most ``MAX_SAMPLE_BYTES``, in order, not
  overlapping, inside the shard's ``bytes`` (at most ``MAX_SHARD_BYTES``); labels -1 or a class;
  digests and SHA-256 hex of their lengths;
* the clip options readers act on (``config.clip``: frames, motion, short side, clips per video).

A refusal is ``BadManifest``: one line naming the file, the field (``splits.train.shards[3].
offsets[7]``) and the reason. Lists are checked with numpy, so a Kinetics-700 manifest (650k
samples, 36 MB) is checked in about 0.5 s on one core here, beside 0.4 s for its JSON parse.
"""
from __future__ import annotations

import re

import numpy as np

from ..base.errors import CommandError
from ..base.words import shown
from . import motionfield
from .tar import BLOCK

MAX_SHARD_BYTES = 1 << 40  # 1 TiB: far above any shard a layout plan makes (GiBs)
MAX_SAMPLE_BYTES = 1 << 28  # 256 MiB: a clip of 8 full-HD JPEGs with motion fields is a few MB
MAX_SAMPLES = 1 << 24  # per shard
MAX_CLASSES = 1 << 20
MAX_FRAMES = 99  # frame members are numbered with two digits
NAME_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
KEY = re.compile(r"[^./\\\x00-\x1f\x7f]{1,255}")
HEX = {16: re.compile(r"[0-9a-f]{16}"), 64: re.compile(r"[0-9a-f]{64}")}
HEXES = re.compile(r"(?:[0-9a-f]{16}\n)*")  # a list of xxh3-64 digests, joined
SHARD_FIELDS = {"name": str, "num_samples": int, "bytes": int, "sha256": str, "keys": list, "offsets": list,
                "lengths": list, "labels": list, "digests": list}
TOP_FIELDS = {"classes": list, "splits": dict, "config": dict, "fingerprint": str, "format": str,
              "identity": str}
# warnings: code -> count
SPLIT_FIELDS = {"shards": list, "num_failed": int, "num_samples": int, "warnings": dict}
CLIP_OPTIONS = {"frames": (1, MAX_FRAMES), "short_side": (0, 1 << 16), "clips_per_video": (1, 1 << 16),
                "eval_clips": (1, 1 << 16)}


class BadManifest(CommandError):
    """A manifest that is not one this build can read safely: exit status 1 (damaged data)."""


def _type_name(value) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _is(value, kind) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


class _Checker:
    """Checks one manifest; ``fail(path, why)`` raises its one line."""

    def __init__(self, where: str, readable: tuple[str, ...], current: str):
        self.where, self.readable, self.current = where, readable, current

    def fail(self, path: str, why: str):
        raise BadManifest(f"{self.where}: {path + ': ' if path else ''}{why}")

    def fields(self, obj, spec: dict, path: str, required: tuple[str, ...]) -> None:
        if not isinstance(obj, dict):
            self.fail(path, f"is {_type_name(obj)}, not an object")
        for name in required:
            if name not in obj:
                self.fail(path, f"field {name!r} missing")
        for name, value in obj.items():
            if name not in spec:
                self.fail(path, f"unknown field {shown(name, 40)} (this build reads {', '.join(spec)})")
            if not _is(value, spec[name]):
                self.fail(f"{path}.{name}".lstrip("."),
                          f"is {_type_name(value)}, not {_type_name(spec[name]())}")

    def manifest(self, d) -> None:
        if not isinstance(d, dict):
            self.fail("", f"the manifest is {_type_name(d)}, not a JSON object")
        fmt = d.get("format")
        if fmt not in self.readable:
            self.fail("format", f"{shown(fmt, 60) if fmt is not None else 'missing'}: this build reads "
                      f"{' and '.join(self.readable)} (a set written by a newer kinetics-fast?)")
        self.fields(d, TOP_FIELDS, "", ("classes", "splits"))
        classes = d["classes"]
        if len(classes) > MAX_CLASSES:
            self.fail("classes", f"{len(classes):,} classes (at most {MAX_CLASSES:,})")
        for i, c in enumerate(classes):
            if not isinstance(c, str):
                self.fail(f"classes[{i}]", f"is {_type_name(c)}, not a string")
        if len(set(classes)) != len(classes):
            twice = next(c for i, c in enumerate(classes) if c in classes[:i])
            self.fail("classes", f"class {shown(twice, 60)} is listed twice")
        self.config(d.get("config", {}))
        names: set[str] = set()
        for split, body in d["splits"].items():
            if not NAME_PART.fullmatch(split):
                self.fail("splits",
                          f"split name {shown(split, 60)} is not a plain name (letters, digits, ._-)")
            path = f"splits.{split}"
            self.fields(body, SPLIT_FIELDS, path, ("shards",))
            if body.get("num_failed", 0) < 0:
                self.fail(f"{path}.num_failed", f"{body['num_failed']} is negative")
            for code, count in body.get("warnings", {}).items():
                if not _is(count, int) or count < 0:
                    self.fail(f"{path}.warnings",
                              f"{shown(code, 40)}: {shown(count, 20)} is not a count of videos")
            total = 0
            for i, shard in enumerate(body["shards"]):
                total += self.shard(shard, f"{path}.shards[{i}]", len(classes), d["format"], names)
            if "num_samples" in body and body["num_samples"] != total:
                self.fail(f"{path}.num_samples",
                          f"{body['num_samples']:,}, its shards list {total:,} samples")

    def config(self, config) -> None:
        clip = config.get("clip", {})
        if not isinstance(clip, dict):
            self.fail("config.clip", f"is {_type_name(clip)}, not an object")
        for name, (low, high) in CLIP_OPTIONS.items():
            value = clip.get(name)
            if value is None:
                continue
            if not _is(value, int) or not low <= value <= high:
                self.fail(f"config.clip.{name}",
                          f"{shown(value, 40)} is not a whole number from {low} to {high}")
        motion = clip.get("motion", "none")
        if motion not in ("none", *motionfield.KINDS):
            self.fail("config.clip.motion", f"{shown(motion, 40)}: this build reads none, "
                      f"{', '.join(motionfield.KINDS)}")

    def shard(self, s, path: str, num_classes: int, fmt: str, names: set[str]) -> int:
        required = tuple(k for k in SHARD_FIELDS if k != "digests" or fmt == self.current)
        self.fields(s, SHARD_FIELDS, path, required)
        name = s["name"]
        parts = name.split("/")
        if not all(NAME_PART.fullmatch(p) and p not in (".", "..") for p in parts):
            self.fail(f"{path}.name", f"{shown(name, 80)} is not a path inside the set (each part a plain "
                      "name: letters, digits, ._-; no '..', no absolute path, no URL)")
        if name in names:
            self.fail(f"{path}.name", f"{shown(name, 80)} is listed twice")
        names.add(name)
        n, size = s["num_samples"], s["bytes"]
        if not 0 <= n <= MAX_SAMPLES:
            self.fail(f"{path}.num_samples", f"{n:,} is not from 0 to {MAX_SAMPLES:,}")
        if not 0 <= size <= MAX_SHARD_BYTES:
            self.fail(f"{path}.bytes", f"{size:,} is not from 0 to {MAX_SHARD_BYTES:,}")
        if not HEX[64].fullmatch(s["sha256"]):
            self.fail(f"{path}.sha256", f"{shown(s['sha256'], 80)} is not 64 lowercase hex digits")
        lists = ("keys", "offsets", "lengths", "labels") + (
            ("digests",) if s.get("digests") or fmt == self.current else ())
        for field in lists:
            if len(s[field]) != n:
                self.fail(f"{path}.{field}", f"{len(s[field]):,} entries for {n:,} samples (num_samples)")
        for i, key in enumerate(s["keys"]):
            if not isinstance(key, str) or not KEY.fullmatch(key):
                self.fail(f"{path}.keys[{i}]", f"{shown(key, 80)} is not a sample key (1-255 characters, "
                          "no '.', '/', '\\' or control characters)")
        if len(set(s["keys"])) != n:
            self.fail(f"{path}.keys", "a key is listed twice")
        digests = s.get("digests", [])
        joined = "\n".join(digests) if all(type(d) is str for d in digests) else None
        for i, digest in enumerate([] if joined is not None and HEXES.fullmatch(joined + "\n") else digests):
            if not isinstance(digest, str) or not HEX[16].fullmatch(digest):
                self.fail(f"{path}.digests[{i}]",
                          f"{shown(digest, 40)} is not 16 lowercase hex digits (xxh3-64)")
        offsets = self.integers(s["offsets"], f"{path}.offsets")
        lengths = self.integers(s["lengths"], f"{path}.lengths")
        labels = self.integers(s["labels"], f"{path}.labels")
        self.ranges(offsets, lengths, size, path)
        wrong = np.flatnonzero((labels < -1) | (labels >= num_classes))
        if wrong.size:
            i = int(wrong[0])
            self.fail(f"{path}.labels[{i}]", f"{int(labels[i])} is not -1 (unlabelled) or a class index "
                      f"(0 to {num_classes - 1}: the manifest has {num_classes} classes)")
        return n

    def integers(self, values: list, path: str) -> np.ndarray:
        if all(type(v) is int for v in values):  # the common case at numpy's speed; else find the culprit
            try:
                array = np.asarray(values, dtype=np.int64)
                if not (np.abs(array) >= 1 << 62).any():
                    return array
            except OverflowError:
                pass
        for i, v in enumerate(values):
            if not _is(v, int) or not -(1 << 62) < v < 1 << 62:
                self.fail(f"{path}[{i}]", f"{shown(v, 40)} is not a whole number in range")
        return np.asarray(values, dtype=np.int64)

    def ranges(self, offsets: np.ndarray, lengths: np.ndarray, size: int, path: str) -> None:
        """Every sample whole tar blocks, at least one header, in order, apart, inside the shard."""
        def first(mask, field, why):
            i = int(np.flatnonzero(mask)[0])
            value = (offsets if field == "offsets" else lengths)[i]
            self.fail(f"{path}.{field}[{i}]", f"{int(value):,} {why}")
        if not offsets.size:
            return
        for field, values, low in (("offsets", offsets, 0), ("lengths", lengths, BLOCK)):
            if (values < low).any():
                first(values < low, field, f"is below {low}")
            if (values % BLOCK).any():
                first(values % BLOCK != 0, field, f"is not a multiple of the tar block ({BLOCK} bytes)")
        if (lengths > MAX_SAMPLE_BYTES).any():
            first(lengths > MAX_SAMPLE_BYTES, "lengths", f"is above the largest sample this build reads "
                  f"({MAX_SAMPLE_BYTES:,} bytes)")
        ends = offsets + lengths
        if (offsets[1:] < ends[:-1]).any():
            i = int(np.flatnonzero(offsets[1:] < ends[:-1])[0]) + 1
            self.fail(f"{path}.offsets[{i}]", f"{int(offsets[i]):,} is before the end of sample {i - 1} "
                      f"({int(ends[i - 1]):,}): samples out of order or overlapping")
        if ends[-1] > size:
            self.fail(f"{path}.lengths[{len(ends) - 1}]",
                      f"the last sample ends at byte {int(ends[-1]):,}, beyond the shard's {size:,} bytes "
                      "(bytes)")


def check(d, where: str, readable: tuple[str, ...], current: str) -> None:
    """Raise ``BadManifest`` unless ``d`` (a parsed manifest from ``where``) is one this build
    reads safely (module docstring): ``readable`` format versions, ``current`` the one whose
    samples carry digests."""
    _Checker(where, readable, current).manifest(d)
