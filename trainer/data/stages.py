"""The stages of a loader worker's pipeline: plain generator functions over samples, each given its plan
(webdataset's style), composed top to bottom in ``ordered_samples`` and ``trainer.data.loader``:

    the plan's reads -> open byte ranges (every sample checked against the manifest's digest)
    -> tar members -> samples (webdataset) -> tag each with its plan index -> release in the planned order
    -> [bad samples: a stand-in for each] -> (the loader) batches -> ``decode_batch``

A bad sample (any fault one sample carries, a ``shards.errors.DataFault`` with its ``key``: bytes that
differ from the manifest's digest, read twice, ``shards.format.digests.CorruptSample``; members the format
refuses, ``shards.format.sample.BadSample``), when the loader goes on without it, is read as one ``BAD``
member of its key holding its record (``bad_record``), and replaced by a repeat of a good sample of the
same worker, marked as padding is (``stand_ins``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import get_worker_info

from shards import partition
from shards.cache import ShardCache
from shards.errors import CommandError, DataFault
from shards.http_range import Retry
from shards.reading import local_path, open_range, open_samples, read_ahead
from shards.format.tar import member_bytes

from .plan import Read, WorkerPlan
from .slots import SlotPool
from .transforms import jpeg_size

# Reading remote ranges without a cache, a worker reads ahead lookahead x this many bytes.
READ_AHEAD_BYTES = 32 << 20
BAD = "corrupt.json"  # the member a bad sample is read as when the loader goes on without it


def open_reads(reads: Iterable[Read], fds: dict[int, int], cache: ShardCache | None, lookahead: int,
               skip_bad: bool, retry: Retry):
    """Stage: each planned read as an open stream of its byte range, closed once consumed. Through
    the node cache, the copies come in read order, downloaded up to ``lookahead`` ahead; remote reads
    without a cache are read ahead by ``lookahead`` x ``READ_AHEAD_BYTES`` in a thread; local ones through
    the rank's shared descriptor of the shard (``fds``) when it has one. Every sample is checked against
    the manifest's digest, whichever way its bytes came (``open_samples``); with ``skip_bad`` a bad one is
    read as a ``BAD`` member of its key (``bad_marker``). A remote source that is down is waited for as
    ``retry`` says (``shards.http_range``)."""
    reads = list(reads)
    if cache is not None:
        copies = cache.stream([r.piece for r in reads], lookahead)
        opened = (open_range(path, r.start - r.piece.start, r.end - r.piece.start, fd=cache.descriptor(r.piece))
                  for r, path in zip(reads, copies))
    elif reads and local_path(reads[0].url) is None:
        opened = read_ahead([(r.url, r.start, r.end, r.info.bytes, r.info.sha256, bool(r.info.digests))
                             for r in reads],
                            lookahead * READ_AHEAD_BYTES, retry)
    else:
        opened = (open_range(r.url, r.start, r.end, fd=fds.get(r.shard), size=r.info.bytes, sha256=r.info.sha256,
                             retry=retry, checked=bool(r.info.digests)) for r in reads)
    try:
        for r, raw in zip(reads, opened):
            stream = open_samples(r.url, r.info, r.start, r.end, fd=fds.get(r.shard), stream=raw,
                                  replace=bad_marker if skip_bad else None, retry=retry)
            try:
                yield {"url": r.url, "stream": stream}
            finally:
                stream.close()
    finally:
        getattr(opened, "close", lambda: None)()
        if cache is not None:
            copies.close()


def tag(samples, expected):
    """Stage: attach each sample's plan index; drop samples read only to keep a range whole."""
    for sample, (key, local) in zip(samples, expected, strict=True):
        if sample["__key__"] != key:
            raise ValueError(f"{sample['__url__']}: found sample {sample['__key__']}, manifest says {key}")
        if local is not None:
            sample["__local__"] = local
            yield sample


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


def bad_record(error: DataFault, **place) -> dict:
    """The record of a sample left out for a fault of its own (module docstring): the fault's facts
    (``url``, ``shard``, ``key``, ``index`` in the shard; a digest's ``expected`` and ``found``), ``place``
    adding those it does not carry, and ``fault``, its one line. Every kind is counted alike."""
    return {**place, **{k: v for k, v in vars(error).items() if k != "message"}, "fault": str(error)}


def bad_marker(error: DataFault, **place) -> bytes:
    """What a bad sample is read as when the loader goes on without it: one tar member of its key
    holding its ``bad_record`` (``stand_ins`` recognises it)."""
    return member_bytes(f"{error.key}.{BAD}", json.dumps(bad_record(error, **place)).encode())


def stand_ins(samples):
    """Stage: each bad sample (a ``BAD`` member in place of its own) replaced by a repeat of the last
    good sample before it, or, for those before the first good one, the first after; the repeat has
    the bad sample's plan index and its ``__bad__`` facts (``decode_batch`` marks it padding)."""
    last, waiting = None, []
    for sample in samples:
        if BAD in sample:
            bad = {"__local__": sample["__local__"], "__bad__": json.loads(sample[BAD])}
            if last is None:
                waiting.append(bad)
            else:
                yield {**last, **bad}
            continue
        yield from ({**sample, **bad} for bad in waiting)
        waiting, last = [], sample
        yield sample
    if waiting:  # nothing good in the worker's whole share
        first = waiting[0]["__bad__"]
        raise DataFault(f"{first['fault']}; no good clip in this loader worker's share to stand in for it",
                        **first)


def ordered_samples(plan: WorkerPlan, fds: dict[int, int], cache: ShardCache | None, lookahead: int,
                    skip_bad: bool, retry: Retry) -> wds.DataPipeline:
    """A worker's samples in its plan's order (stand-ins in place of bad ones with ``skip_bad``; a source
    that is down waited for as ``retry`` says)."""
    return wds.DataPipeline(
        lambda: iter(plan.reads),
        lambda reads: open_reads(reads, fds, cache, lookahead, skip_bad, retry),
        wds.tariterators.tar_file_expander,
        wds.tariterators.group_by_keys,
        lambda src: tag(src, plan.expected),
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


def decode_batch(samples: list[dict], plan: WorkerPlan, how: Decoding, pool: SlotPool | None, worker: int) -> dict:
    """Stage: a batch of samples -> its pixels in a slot of ``pool`` (only the slot number and the
    metadata travel on), or, ``on_device``, its JPEG bytes and geometry."""
    keys = [s["__key__"] for s in samples]
    rngs = [partition.rng_for("augment", how.seed, how.epoch, k) for k in keys]
    real = [s["__local__"] < plan.valid_locals for s in samples]  # not a padding repeat
    out = {"keys": keys, "labels": [int(s["cls"]) if "cls" in s else -1 for s in samples],
           "valid": [r and "__bad__" not in s for r, s in zip(real, samples)]}
    if how.skip_bad:
        out["bad"] = [s["__bad__"] | {"slot": i} for i, (r, s) in enumerate(zip(real, samples)) if r and "__bad__" in s]
    transform = how.transform
    frames = [transform.members(s) for s in samples]
    if how.on_device:  # only the headers are parsed here
        return out | pack_jpegs([{"jpegs": f, "geometry": transform.geometry(*jpeg_size(f[0]), rng)}
                                 for f, rng in zip(frames, rngs)])
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
    for f, rng, dest in zip(frames, rngs, pixels):
        transform.into(f, rng, dest)
    return out


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
