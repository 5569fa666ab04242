"""The stages of a loader worker's pipeline: plain generator functions over samples, each given its plan
(webdataset's style), composed top to bottom in ``ordered_samples`` and ``trainer.data.loader``:

    the plan's reads -> each read's samples at the manifest's offsets, checked against its digests and
    parsed by the format's schema (``shards.read.reading.iter_samples``), tagged with their plan index
    -> release in the planned order -> [bad samples: a stand-in for each] -> (the loader) batches
    -> ``decode_batch``

A sample is a dict: ``__key__``, ``__url__``, ``__local__`` (its plan index), ``frames`` and ``fields``
(memoryviews of its JPEGs and motion PNGs, in frame order), ``label``. A bad sample (bytes that differ
from the manifest's digest, read twice: ``shards.format.digests``; members the schema refuses:
``shards.format.sample.BadSample``; a frame that does not decode), when the loader goes on without it,
is replaced by a repeat of a good sample of the same worker, marked as padding is (``stand_ins``,
``decode_batch``), its ``__bad__`` facts listed for the budget (``shards.read.reading.bad_facts``).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import get_worker_info

from shards.base.errors import CommandError, DataFault
from shards.format.sample import DECODE_ERRORS, BadSample, Sample, jpeg_size
from shards.io.http_range import Retry, take_waits
from shards.plan import partition
from shards.read.cache import ShardCache
from shards.read.reading import bad_facts, iter_samples, local_path, open_range, read_ahead

from .plan import Read, WorkerPlan
from .slots import SlotPool

# Reading remote ranges without a cache, a worker reads ahead lookahead x this many bytes.
READ_AHEAD_BYTES = 32 << 20


def open_reads(reads: Iterable[Read], fds: dict[int, int], cache: ShardCache | None, lookahead: int,
               skip_bad: bool, retry: Retry):
    """Stage: each planned read as (the read, an open stream of its byte range). Through the node
    cache, the copies come in read order, downloaded up to ``lookahead`` ahead; remote reads without a
    cache are read ahead by ``lookahead`` x ``READ_AHEAD_BYTES`` in a thread; local ones through the
    rank's shared descriptor of the shard (``fds``) when it has one. A remote source that is down is
    waited for as ``retry`` says (``shards.io.http_range``)."""
    reads = list(reads)
    if cache is not None:
        copies = cache.stream([r.piece for r in reads], lookahead)
        opened = (open_range(path, r.start - r.piece.start, r.end - r.piece.start,
                             fd=cache.descriptor(r.piece))
                  for r, path in zip(reads, copies))
    elif reads and local_path(reads[0].url) is None:
        opened = read_ahead([(r.url, r.start, r.end, r.info.bytes, r.info.sha256, bool(r.info.digests))
                             for r in reads],
                            lookahead * READ_AHEAD_BYTES, retry)
    else:
        opened = (open_range(r.url, r.start, r.end, fd=fds.get(r.shard), size=r.info.bytes,
                             sha256=r.info.sha256, retry=retry, checked=bool(r.info.digests))
                  for r in reads)
    try:
        for r, raw in zip(reads, opened):
            try:
                yield r, raw
            finally:
                raw.close()
    finally:
        getattr(opened, "close", lambda: None)()
        if cache is not None:
            copies.close()


def planned_samples(opened, plan: WorkerPlan, fds: dict[int, int], skip_bad: bool, frames: int | None,
                    motion: str, retry: Retry):
    """Stage: the samples of each opened read, at the manifest's offsets and lengths, every one checked
    against the manifest's digest and parsed by the schema (``iter_samples``), as the dicts the later
    stages take (module docstring); those read only to keep a range whole are dropped. With ``skip_bad``
    a bad sample comes as its ``__bad__`` facts, else its fault is raised."""
    expected = iter(plan.expected)
    for r, raw in opened:
        first, stop = bisect.bisect_left(r.info.offsets, r.start), bisect.bisect_left(r.info.offsets, r.end)
        for i, sample in iter_samples(r.url, r.info, first, stop, skip_bad, frames=frames, motion=motion,
                                      fd=fds.get(r.shard), stream=raw, retry=retry):
            key, local = next(expected)
            if local is None:
                continue
            out = {"__key__": key, "__url__": r.url, "__local__": local, "__shard__": r.info.name,
                   "__index__": i}
            if isinstance(sample, Sample):
                yield out | {"frames": sample.frames, "fields": sample.fields, "label": sample.label}
            else:
                yield out | {"__bad__": bad_facts(r.url, r.info.name, key, i, sample)}


def in_order(samples, order):
    """Stage: release samples in the planned order, holding those that arrive early."""
    held, it = {}, iter(order)
    want = next(it, None)
    for sample in samples:
        held[sample["__local__"]] = sample
        while want is not None and want in held:
            yield held.pop(want)
            want = next(it, None)
    if want is not None:
        raise RuntimeError(f"stream ended before planned sample {want}")


def stand_ins(samples):
    """Stage: each bad sample (its ``__bad__`` facts in place of its members) replaced by a repeat of the last
    good sample before it, or, for those before the first good one, the first after; the repeat has
    the bad sample's plan index and its ``__bad__`` facts (``decode_batch`` marks it padding)."""
    last, waiting = None, []
    for sample in samples:
        if "__bad__" in sample:
            bad = {"__local__": sample["__local__"], "__bad__": sample["__bad__"]}
            if last is None:
                waiting.append(bad)
            else:
                yield {**last, **bad}
            continue
        yield from ({**sample, **bad} for bad in waiting)
        waiting, last = [], sample
        yield sample
    if waiting:  # nothing good in the worker's whole share
        raise DataFault(f"{waiting[0]['__bad__']['line']}; no good clip in this loader worker's share to "
                        "stand in for it")


def ordered_samples(plan: WorkerPlan, fds: dict[int, int], cache: ShardCache | None, lookahead: int,
                    skip_bad: bool, retry: Retry, frames: int | None = None,
                    motion: str = "none") -> wds.DataPipeline:
    """A worker's samples in its plan's order, parsed as a set of ``frames`` frames and ``motion`` fields
    (``Manifest.frames``, ``Manifest.motion``) holds them (stand-ins in place of bad ones with ``skip_bad``;
    a source that is down waited for as ``retry`` says)."""
    return wds.DataPipeline(
        lambda: iter(plan.reads),
        lambda reads: open_reads(reads, fds, cache, lookahead, skip_bad, retry),
        lambda opened: planned_samples(opened, plan, fds, skip_bad, frames, motion, retry),
        lambda src: in_order(src, plan.order),
        *([stand_ins] if skip_bad else []),
    )


def refusals_as_batches(batches):
    """Last stage: a refusal (``CommandError``, such as ``CacheFull``; a ``DataFault``, such as a
    ``CorruptSample`` or ``SourceUnavailable``) takes the place of the next batch, so the rank raises
    it with its own one-line message (PyTorch would re-raise one from a loader worker with the
    worker's traceback as its message). webdataset's tar reader adds the stream and URL to the args
    of an error raised while it reads a shard: the refusal goes on with its own message alone (the
    stream could not even be sent from a worker)."""
    try:
        yield from batches
    except CommandError as refusal:
        refusal.args = refusal.args[:1]
        yield refusal


@dataclass(frozen=True)
class Decoding:
    """How a worker turns a batch of samples into pixels: the transform, the draws' seed and epoch,
    whether bad samples are listed, JPEG bytes for the GPU instead of pixels, multigrid's parts."""
    transform: object
    seed: int
    epoch: int
    skip_bad: bool = False
    on_device: bool = False
    renderer: object = None  # multigrid: each batch as parts of their own shape (trainer.data.shapes)


def decode_batch(samples: list[dict], plan: WorkerPlan, how: Decoding, pool: SlotPool | None,
                 worker: int) -> dict:
    """Stage: a batch of samples -> its pixels in a slot of ``pool`` (only the slot number and the
    metadata travel on), or, ``on_device``, its JPEG bytes and geometry; ``waits``: the outages this
    worker's reads met since its last batch, and the seconds they waited (``http_range.take_waits``)."""
    keys = [s["__key__"] for s in samples]
    rngs = [partition.rng_for("augment", how.seed, how.epoch, k) for k in keys]
    real = [s["__local__"] < plan.valid_locals for s in samples]  # not a padding repeat
    out = {"keys": keys, "labels": [s["label"] for s in samples],
           "valid": [r and "__bad__" not in s for r, s in zip(real, samples)], "waits": take_waits()}
    if how.skip_bad:
        out["bad"] = [s["__bad__"] | {"slot": i} for i, (r, s) in enumerate(zip(real, samples))
                      if r and "__bad__" in s]
    transform = how.transform
    frames = [transform.members(s) for s in samples]
    if how.on_device:  # only the headers are parsed here
        return out | pack_jpegs([{"jpegs": f,
                                  "geometry": transform.geometry(*decoded(jpeg_size, s, f[0]), rng)}
                                 for f, rng, s in zip(frames, rngs, samples)])
    if how.renderer is not None:  # the parts one after the other, flat
        shape = (how.renderer.nbytes,)
    else:
        shape = (len(samples), *transform.shape(len(frames[0])))
    slot = pool.acquire(worker) if pool and pool.fits(shape) else None
    if slot is None:  # all this worker's slots are held: memory of its own, as DataLoader would
        clips = torch.empty(shape, dtype=torch.uint8)
        pixels = (clips.share_memory_() if get_worker_info() else clips).numpy()
        out["clips"] = clips
    else:
        pixels = pool.array(slot, shape)
        out["slot"], out["shape"] = slot, shape
    if how.renderer is not None:
        how.renderer.render(frames, rngs, pixels)
        return out
    undecodable = []
    for i, (f, rng, dest, s) in enumerate(zip(frames, rngs, pixels, samples)):
        try:
            decoded(transform.into, s, f, rng, dest)
        except BadSample as e:
            if not how.skip_bad:
                raise
            undecodable.append((i, e))
    _stand_in_rows(undecodable, samples, real, pixels, out)
    return out


def _stand_in_rows(undecodable: list[tuple[int, BadSample]], samples: list[dict], real: list[bool],
                   pixels, out: dict) -> None:
    """Rows whose frames did not decode: each the pixels of the batch's first good row, marked as
    padding is, and listed with the batch's bad samples; a batch with no good row raises its first."""
    if not undecodable:
        return
    failed = {i for i, _ in undecodable}
    good = next((i for i in range(len(samples)) if i not in failed and out["valid"][i]), None)
    if good is None:
        raise undecodable[0][1]
    for i, error in undecodable:
        pixels[i] = pixels[good]
        out["valid"][i] = False
        s = samples[i]
        if real[i]:
            out["bad"].append(bad_facts(s["__url__"], s["__shard__"], s["__key__"], s["__index__"], error)
                              | {"slot": i})


def decoded(render, sample: dict, *args):
    """``render(*args)`` (a transform's ``into``, ``jpeg_size``) for the frames of ``sample``: a frame
    that does not decode is a ``BadSample`` of it, counted as a digest that differs is."""
    where = f"{sample['__url__']}: shard {sample['__shard__']}"
    try:
        return render(*args)
    except BadSample as e:
        raise BadSample.of(where, sample["__key__"], e.why) from None
    except DECODE_ERRORS as e:
        raise BadSample.of(where, sample["__key__"],
                           f"a frame does not decode ({type(e).__name__}: {e})") from None


def pack_jpegs(samples) -> dict:
    """Undecoded frames and their geometry for ``trainer.data.device_decode``: all JPEG bytes of the
    batch in one uint8 tensor with offsets (one shared-memory transfer instead of B x T)."""
    jpegs = [j for s in samples for j in s["jpegs"]]
    geometries = [s["geometry"] for s in samples]
    return {"jpeg_data": torch.frombuffer(bytearray(b"".join(jpegs)), dtype=torch.uint8),
            "jpeg_offsets": torch.tensor(np.cumsum([0] + [len(j) for j in jpegs]), dtype=torch.int64),
            "frames": len(samples[0]["jpegs"]), "side": geometries[0].side,
            "boxes": torch.tensor([g.boxes for g in geometries], dtype=torch.float64),
            "flip": torch.tensor([g.flip for g in geometries], dtype=torch.bool)}
