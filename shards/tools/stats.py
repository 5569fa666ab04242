"""Counts per split and class, bytes, frames per clip and frame sizes; --json for machines.

Counts and bytes come from the manifest alone, with the videos that failed at ingest and those
used with a caveat (its ledger's warnings: few frames, a still image, no motion vectors, smaller
than the short side, annotated but not found). Frames per clip and frame sizes come from
reading clips: ``--probe N`` evenly spread clips per split (one byte-range read each), or
every clip with ``--probe 0`` (one sequential read per shard). JPEG headers give the sizes;
no frame is decoded. A set with motion fields (``shards.format.motionfield``) has the probed clips'
fields decoded for their magnitude statistics: the share of valid cells, and over those the
mean, median and 95th percentile of the motion's length in pixels per frame and the share
clipped at the quantisation bound.

Every clip read is checked against the manifest's digest and parsed by the format's schema, as the
trainer reads it (``shards.format.digests``, ``shards.format.sample``): one that differs, that the
schema refuses or whose frame headers or fields do not decode is left out of the figures and named,
and the command ends with exit status 1 after printing them (as ``shards verify`` does on a problem).
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter

import numpy as np

from ..base.errors import DataFault
from ..base.words import plural
from ..format import motionfield
from ..format.digests import ALGORITHM, CorruptSample
from ..format.manifest import Manifest, SplitInfo
from ..format.sample import BadSample, Sample
from ..read.reading import iter_samples


def _probe_samples(manifest: Manifest, split: SplitInfo, probe: int):
    """The probed samples of a split, checked and parsed (``Sample``): a bad one comes as its fault
    (``CorruptSample``, ``BadSample``)."""
    if probe == 0:
        for shard in split.shards:
            for _, data in iter_samples(manifest.shard_url(shard), shard, 0, shard.num_samples, bad=True,
                                        frames=manifest.frames, motion=manifest.motion):
                yield data
        return
    starts = np.cumsum([0] + [s.num_samples for s in split.shards])
    for g in np.unique(np.linspace(0, split.num_samples - 1, min(probe, split.num_samples)).astype(int)):
        k = int(np.searchsorted(starts, g, side="right")) - 1
        shard, i = split.shards[k], int(g - starts[k])
        for _, data in iter_samples(manifest.shard_url(shard), shard, i, i + 1, bad=True,
                                    frames=manifest.frames, motion=manifest.motion):
            yield data


def _bad_entry(fault) -> dict:
    """A bad sample as the figures list it: its shard, key and why, and a digest's two values."""
    if isinstance(fault, CorruptSample):
        return {"shard": fault.shard, "key": fault.key, "expected": fault.expected, "found": fault.found,
                "why": f"{ALGORITHM} digest {fault.found}, the manifest says {fault.expected}"}
    return {"shard": fault.where.rsplit(": shard ", 1)[-1], "key": fault.key, "why": fault.why}


def _field(sample: Sample, png):
    """A motion field decoded (``motionfield.decode``): a ``BadSample`` when it does not decode."""
    try:
        return motionfield.decode(png)
    except (OSError, ValueError, SyntaxError) as e:
        raise BadSample.of(sample.where, sample.key, f"a motion field does not decode ({e})") from None


def split_stats(manifest: Manifest, name: str, probe: int) -> dict:
    split = manifest.splits[name]
    labels = Counter(label for s in split.shards for label in s.labels)
    sizes = [s.bytes for s in split.shards] or [0]
    frames, frame_sizes, frame_bytes, probed = Counter(), Counter(), [], 0
    lengths, cells, clipped, bad = [], 0, 0, []
    for sample in _probe_samples(manifest, split, probe):
        probed += 1
        try:
            if not isinstance(sample, Sample):
                raise sample
            sizes_of = sample.frame_sizes()
            fields = [_field(sample, v) for v in sample.fields]
        except (CorruptSample, BadSample) as e:
            bad.append(_bad_entry(e))
            continue
        for field, valid in fields:
            cells += valid.size
            lengths.append(np.hypot(field[valid][:, 0], field[valid][:, 1]))
            clipped += int((np.abs(field[valid]) >= motionfield.BOUND).any(axis=1).sum())
        frames[len(sample.frames)] += 1
        for (w, h), j in zip(sizes_of, sample.frames):
            frame_sizes[f"{w}x{h}"] += 1
            frame_bytes.append(len(j))
    return {
        "clips": split.num_samples, "shards": len(split.shards), "bytes": split.num_bytes,
        "failed_at_ingest": split.num_failed,
        "warnings_at_ingest": split.warnings,
        "bytes_per_clip": split.num_bytes / max(1, split.num_samples),
        "shard_bytes": {"min": min(sizes), "median": statistics.median(sizes), "max": max(sizes)},
        "classes": {manifest.classes[c] if c >= 0 else "(unlabeled)": n for c, n in sorted(labels.items())},
        "probed_clips": probed,
        "bad_samples": bad,
        "frames_per_clip": dict(sorted(frames.items())),
        "frame_sizes": dict(frame_sizes.most_common()),
        "bytes_per_frame": statistics.mean(frame_bytes) if frame_bytes else None,
        **({"motion": _motion_stats(manifest.motion, lengths, cells, clipped)}
           if manifest.motion != "none" else {}),
    }


def _motion_stats(kind: str, lengths: list[np.ndarray], cells: int, clipped: int) -> dict:
    """Magnitude statistics of the probed fields' valid cells (pixels per frame)."""
    valid = np.concatenate(lengths) if lengths else np.zeros(0)
    figures = ({"mean": float(valid.mean()), "median": float(np.median(valid)),
                "p95": float(np.percentile(valid, 95))} if valid.size else {})
    return {"kind": kind, "cells": cells, "valid_fraction": valid.size / cells if cells else 0.0,
            "clipped_fraction": clipped / valid.size if valid.size else 0.0, **figures}


def collect(manifest: Manifest, probe: int = 64, splits: list[str] | None = None) -> dict:
    return {"classes": len(manifest.classes), "identity": manifest.identity,
            "fingerprint": manifest.fingerprint,
            "splits": {n: split_stats(manifest, n, probe) for n in manifest.splits
                       if not splits or n in splits}}


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def format_text(stats: dict) -> str:
    lines = [f"shard set {stats['identity']}, {stats['classes']} classes, "
             f"inputs' fingerprint {stats['fingerprint']}"]
    for name, s in stats["splits"].items():
        sb = s["shard_bytes"]
        lines.append(f"{name}: {plural(s['clips'], 'clip')} in {plural(s['shards'], 'shard')}, "
                     f"{_mb(s['bytes'])} ({s['bytes_per_clip'] / 1e3:,.1f} kB/clip), "
                     f"{s['failed_at_ingest']} failed at ingest"
                     + (", warnings: " + ", ".join(f"{n} x {code}" for code, n in Counter(
                         s["warnings_at_ingest"]).most_common()) if s["warnings_at_ingest"] else ""))
        lines.append(f"  shard size min/median/max: {_mb(sb['min'])} / {_mb(sb['median'])} / "
                     f"{_mb(sb['max'])}")
        counts = sorted(s["classes"].items(), key=lambda kv: -kv[1])
        shown = counts if len(counts) <= 12 else counts[:5] + [("...", "")] + counts[-5:]
        lines.append("  clips per class: " + ", ".join(f"{c} {n}" for c, n in shown))
        if s["bytes_per_frame"] is not None:  # some clip read was whole
            clips = ", ".join(f"{plural(n, 'clip')} of {plural(int(t), 'frame')}"
                              for t, n in s["frames_per_clip"].items())
            sizes = ", ".join(f"{plural(n, 'frame')} of {size} px" for size, n in s["frame_sizes"].items())
            lines.append(f"  from {plural(s['probed_clips'], 'clip')} read: {clips}; {sizes}; "
                         f"{s['bytes_per_frame'] / 1e3:,.1f} kB/frame")
        if s["bad_samples"]:
            lines.append(f"  {len(s['bad_samples'])} of the {s['probed_clips']} clips read are damaged "
                         "(left out of these figures):")
            lines += [f"    {b['shard']}: sample {b['key']}: {b['why']}" for b in s["bad_samples"]]
        if "mean" in s.get("motion", {}):
            mo = s["motion"]
            lines.append(f"  motion ({mo['kind']}): {mo['valid_fraction']:.0%} of cells valid; length mean "
                         f"{mo['mean']:.2f}, median {mo['median']:.2f}, p95 {mo['p95']:.2f} px/frame; "
                         f"{mo['clipped_fraction']:.1%} clipped at {motionfield.BOUND:g}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shardset", help="shard-set directory URL or manifest.json URL")
    p.add_argument("--split", action="append", help="only this split (repeatable)")
    p.add_argument("--probe", type=int, default=64,
                   help="clips read per split for frame counts and sizes (0: all)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    stats = collect(Manifest.load(args.shardset), args.probe, args.split)
    print(json.dumps(stats, sort_keys=True) if args.json else format_text(stats))
    bad = [(name, b) for name, s in stats["splits"].items() for b in s["bad_samples"]]
    if bad:
        named = (", ".join(f"{b['shard']} sample {b['key']}" for _, b in bad[:3])
                 + (", ..." if len(bad) > 3 else ""))
        raise DataFault(f"{len(bad)} clip{'s' if len(bad) > 1 else ''} read "
                        f"{'are' if len(bad) > 1 else 'is'} damaged ({named}): {bad[0][1]['why']}; "
                        f"shards verify {args.shardset} checks every clip")
    return 0
