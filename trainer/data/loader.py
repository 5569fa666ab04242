"""Streaming clip loader: WebDataset shards -> uint8 batches (B, T, C, H, W), equal on every rank.

Who reads what, in which order, is decided by the pure functions of ``shards.partition``;
this module only carries it out. The data path of one loader worker, top to bottom:

    byte ranges of shards (one open each; local descriptors opened once by the rank and
    shared with its forked workers), every sample checked against the manifest's digest
    -> tar members (webdataset) -> samples (webdataset)
    -> tag each with its position in the plan -> release in the planned shuffled order
    -> [bad samples: a stand-in for each] -> batches of undecoded samples (webdataset)
    -> decode + TSM transform into a batch slot

The sample shuffle is the bounded buffer of ``partition.buffer_shuffle`` computed on indices,
not webdataset's ``shuffle`` stage, whose RNG state a checkpoint could not capture: knowing
the order in advance is what makes mid-epoch and elastic resume exact.

Batches: ``clips`` uint8 (B, T, C, H, W), a view of the channels-last memory the frames
were decoded into (the CPU never transposes; ``clips.flatten(0, 1)`` is (B*T, C, H, W) in
``torch.channels_last`` format, which cuDNN prefers; ``.contiguous()`` if NCHW is needed).
That memory is a slot of the loader's shared-memory pool (``trainer.data.slots``): workers decode
into it and send only its number; it is reused once every view of the batch's clips is gone,
so a batch may be held as long as wanted (holding more than the pool has left costs speed,
not correctness). Also ``labels`` int64 (-1 unlabeled); ``keys``; ``videos``; ``valid`` (False for padding
repeats); ``global_valid``, the real clips in this batch and the same batch of every other rank
together (one optimizer step's, for the loss weights and the clips seen).

With ``decode_on_device=True`` workers only parse JPEG headers and draw the crops: batches carry
the undecoded bytes and their geometry instead of ``clips``, for ``trainer.data.device_decode``.
With ``modality="motion"`` the clips are the samples' stored motion fields rendered with the
geometry their frames would get (``trainer.data.motion``): (B, T, 2, H, W), the rest alike.
With ``shapes`` (multigrid, ``trainer.data.shapes.EpochShapes``) an epoch's batches hold
``shapes.batch_size(epoch)`` clips, decoded as ``parts`` of their own shapes (fewer frames, smaller
crops; ``trainer.data.shapes``): the batch carries ``parts``, one batch per optimizer step, instead of ``clips``.

Bad samples (bytes that differ from the manifest's digest, read twice: ``shards.digests``): by
default the first ends the iteration with its ``CorruptSample``, a ``DataFault`` naming the shard,
the sample, both digests and the URL. With ``max_bad_samples`` (N, or None: the caller keeps the
budget, as ``trainer.bad_samples`` does over every rank) the loader goes on without them: a bad
sample's place in its batch is taken by a repeat of a good clip of the same worker (the one before
it, or for the first ones the one after), marked ``valid`` False as a padding repeat is, so every
rank still yields the same batches of the same size and every good clip is read once; the batch's
``bad`` lists what was left out (``url``, ``shard``, ``key``, ``index`` in the shard, ``clip``: its
position in the split, as the viewer numbers clips, ``split``, ``expected`` and ``found`` digests,
``rank``, ``slot`` in the batch). A bad sample met again as a padding repeat is left out unlisted.
Past N in an epoch the iteration ends with ``TooManyBadSamples`` before the batch that went over.

The manifest is the only other thing read. Pass a ``Manifest`` object to avoid even that:
``shared_manifest`` lets rank 0 read it and broadcasts it over the job's collective (one
open per job instead of one per rank, at job start when every rank would hit the metadata
server at once); loader workers inherit it from the rank process.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import warnings
from dataclasses import asdict

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from shards import partition
from shards.direct import load_manifest
from shards.cache import Piece, ShardCache
from shards.digests import CorruptSample, TooManyBadSamples
from shards.errors import CommandError, UsageError
from shards.manifest import Manifest, set_title
from shards.reading import local_path, open_fd, open_range, open_samples, read_ahead
from shards.tarformat import member_bytes

from .motion import MotionTransform
from .shapes import PartsRenderer, unpack
from .slots import SlotPool
from .transforms import EvalTransform, TrainTransform, jpeg_size

log = logging.getLogger(__name__)

# A rank opens the local shards it reads once and its forked workers share the descriptors;
# above this many (small world sizes, where metadata load is no concern) workers open their own.
SHARED_FDS_MAX = 256
# Batches a DataLoader worker works ahead (its prefetch factor); the slot pool has two more per worker.
PREFETCH = 2
# Reading remote ranges without a cache, a worker reads ahead lookahead x this many bytes.
READ_AHEAD_BYTES = 32 << 20
SHUFFLES = ("global", "node")  # one order for all ranks each epoch; or node-affine (shards.partition)
BAD = "corrupt.json"  # the member a bad sample is read as when the loader goes on without it


class OtherShardSet(UsageError, ValueError):
    """A position (``ClipLoader.state_dict``) saved on another shard set or split than the loader
    reads: continuing it would read other clips in another order. The message names both sets."""


def shared_manifest(url: str, rank: int, broadcast, direct: str = "never") -> Manifest:
    """Rank 0 reads the manifest; the others receive it via ``broadcast(obj, root_rank)``,
    e.g. ``horovod.torch.broadcast_object``. ``direct``: direct reads (``shards.direct``)."""
    return broadcast(load_manifest(url, direct) if rank == 0 else None, 0)


def _leave_stop_signals_to_the_trainer(worker_id: int) -> None:
    """A loader worker ignores SIGTERM and SIGINT: the trainer's process takes them, stops at a
    step boundary, checkpoints and then ends its workers. Slurm (``scancel``, the time limit)
    and Ctrl-C signal every process of the job or terminal, and PyTorch's handler in a worker
    dies of SIGTERM, which ends the trainer ("DataLoader worker ... is killed by signal")
    before it can save. A worker whose trainer is gone exits by itself (PyTorch checks its
    parent every 5 s)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Upsampling(UserWarning):
    """Crops larger than the stored frames: the clips are upscaled (``upsampling``)."""


def upsampling(manifest: Manifest, transform) -> str | None:
    """Why ``transform``'s crops of this set's frames are upscaled, or None: a training crop
    larger than the frames' short side as stored, or an evaluation scale or crop larger than it."""
    short = manifest.config.get("clip", {}).get("short_side")  # as ingest writes it; other sets may lack it
    need = transform.crop_size if isinstance(transform, TrainTransform) else max(transform.crop_size,
                                                                                  transform.scale_size)
    if not short or need <= short:
        return None
    return (f"crop_size={transform.crop_size}, scale_size={transform.scale_size}: the frames of "
            f"{manifest.base or 'the shard set'} are {short} pixels on their short side, so the clips are "
            f"upscaled (scale_size={short}, crop_size={short * transform.crop_size // transform.scale_size} "
            "would crop them as stored)")


def placement(rank: int | None = None, world_size: int | None = None,
              local_size: int | None = None) -> tuple[int, int, int]:
    """(rank, world size, ranks per node) as given, else from ``torch.distributed`` when it is
    initialised, else from the environment torchrun, Lightning and Slurm launchers set (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``), else one process. Ranks per node come from
    ``LOCAL_WORLD_SIZE`` only when the world size was not given either."""
    if world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            found = dist.get_rank(), dist.get_world_size()
        else:
            found = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        rank, world_size = found[0] if rank is None else rank, found[1]
        if local_size is None:
            local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return (0 if rank is None else rank), world_size, (1 if local_size is None else local_size)


def video_id(key: str) -> str:
    """``<video>_c<clip>`` -> ``<video>``: clips of one video share it."""
    return key.rsplit("_c", 1)[0]


def _open_reads(reads, cache: ShardCache | None, lookahead: int, skip_bad: bool):
    """Stage: each planned read as an open stream of its byte range, closed once consumed. Through
    the node cache, the copies come in read order, downloaded up to ``lookahead`` ahead; remote reads
    without a cache are read ahead by ``lookahead`` x ``READ_AHEAD_BYTES`` in a thread. Every sample
    is checked against the manifest's digest, whichever way its bytes came (``open_samples``); with
    ``skip_bad`` a bad one is read as a ``BAD`` member of its key (``_bad_marker``)."""
    reads = list(reads)
    if cache is not None:
        copies = cache.stream([r["piece"] for r in reads], lookahead)
        opened = (open_range(path, r["start"] - r["piece"].start, r["end"] - r["piece"].start,
                             fd=cache.descriptor(r["piece"])) for r, path in zip(reads, copies))
    elif reads and local_path(reads[0]["url"]) is None:
        opened = read_ahead([(r["url"], r["start"], r["end"], r["size"], r["sha256"]) for r in reads],
                            lookahead * READ_AHEAD_BYTES)
    else:
        opened = (open_range(r["url"], r["start"], r["end"], fd=r["fd"], size=r["size"], sha256=r["sha256"])
                  for r in reads)
    try:
        for r, raw in zip(reads, opened):
            stream = open_samples(r["url"], r["shard_info"], r["start"], r["end"], fd=r["fd"], stream=raw,
                                  replace=_bad_marker if skip_bad else None)
            try:
                yield {"url": r["url"], "stream": stream}
            finally:
                stream.close()
    finally:
        getattr(opened, "close", lambda: None)()
        if cache is not None:
            copies.close()


def _tag(samples, expected):
    """Stage: attach each sample's local plan index; drop samples read only to keep a range whole."""
    for sample, (key, local) in zip(samples, expected, strict=True):
        if sample["__key__"] != key:
            raise ValueError(f"{sample['__url__']}: found sample {sample['__key__']}, manifest says {key}")
        if local is not None:
            sample["__local__"] = local
            yield sample


def _in_order(samples, order):
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


def _bad_marker(error: CorruptSample) -> bytes:
    """What a bad sample is read as when the loader goes on without it: one tar member of its key
    holding what was found (``_stand_ins`` recognises it)."""
    return member_bytes(f"{error.key}.{BAD}", json.dumps(error.facts()).encode())


def _stand_ins(samples):
    """Stage: each bad sample (a ``BAD`` member in place of its own) replaced by a repeat of the last
    good sample before it, or, for those before the first good one, the first after; the repeat has
    the bad sample's plan index and its ``__bad__`` facts (``_Streams._decode`` marks it padding)."""
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
        raise CorruptSample.of(**waiting[0]["__bad__"], why="read twice; no good clip in this loader worker's "
                               "share to stand in for it")


def _pack_jpegs(samples) -> dict:
    """Undecoded frames and their geometry for ``trainer.data.device_decode``: all JPEG bytes of the
    batch in one uint8 tensor with offsets (one shared-memory transfer instead of B x T)."""
    jpegs = [j for s in samples for j in s["jpegs"]]
    geometries = [s["geometry"] for s in samples]
    return {"jpeg_data": torch.frombuffer(bytearray(b"".join(jpegs)), dtype=torch.uint8),
            "jpeg_offsets": torch.tensor(np.cumsum([0] + [len(j) for j in jpegs]), dtype=torch.int64),
            "frames": len(samples[0]["jpegs"]), "side": geometries[0].side,
            "boxes": torch.tensor([g.boxes for g in geometries], dtype=torch.float64),
            "flip": torch.tensor([g.flip for g in geometries], dtype=torch.bool)}


def _refusals_as_batches(batches):
    """Stage, in a loader worker: a refusal (``CommandError``, such as ``CacheFull``) takes the place of
    the next batch, so the rank raises it with its own one-line message (PyTorch would re-raise it
    with the worker's traceback as its message)."""
    try:
        yield from batches
    except CommandError as refusal:
        yield refusal


class _Streams(IterableDataset):
    """The rank's streams; DataLoader worker i runs ``plans[i]`` (one stream per worker)."""

    def __init__(self, plans, transform, batch_size, seed, epoch, decode_on_device, pool, renderer=None,
                 cache=None, lookahead=2, skip_bad=False):
        self.plans, self.transform, self.batch_size = plans, transform, batch_size
        self.cache, self.lookahead, self.skip_bad = cache, lookahead, skip_bad
        self.seed, self.epoch, self.decode_on_device, self.pool = seed, epoch, decode_on_device, pool
        self.renderer = renderer  # multigrid: each batch as parts of their own shape (trainer.data.shapes)

    def _decode(self, samples: list[dict]) -> dict:
        """Stage: a batch of samples -> its pixels in a pool slot (only the slot number and the
        metadata travel on), or, with ``decode_on_device``, its JPEG bytes and geometry."""
        keys = [s["__key__"] for s in samples]
        rngs = [partition.rng_for("augment", self.seed, self.epoch, k) for k in keys]
        real = [s["__local__"] < self.plan["valid_locals"] for s in samples]  # not a padding repeat
        out = {"keys": keys, "labels": [int(s["cls"]) if "cls" in s else -1 for s in samples],
               "valid": [r and "__bad__" not in s for r, s in zip(real, samples)]}
        if self.skip_bad:
            out["bad"] = [s["__bad__"] | {"slot": i} for i, (r, s) in enumerate(zip(real, samples))
                          if r and "__bad__" in s]
        frames = [self.transform.members(s) for s in samples]
        if self.decode_on_device:  # only the headers are parsed here
            return out | _pack_jpegs([{"jpegs": f, "geometry": self.transform.geometry(*jpeg_size(f[0]), rng)}
                                      for f, rng in zip(frames, rngs)])
        if self.renderer is not None:  # the parts one after the other, flat
            shape = (self.renderer.nbytes,)
        else:
            shape = (len(samples), *self.transform.shape(len(frames[0])))
        slot = self.pool.acquire(self.worker) if self.pool and self.pool.fits(shape) else None
        if slot is None:  # all this worker's slots are held: memory of its own, as DataLoader would
            clips = torch.empty(shape, dtype=torch.uint8)
            pixels = (clips.share_memory_() if get_worker_info() else clips).numpy()
            out["clips"] = clips
        else:
            pixels = self.pool.array(slot, shape)
            out["slot"], out["shape"] = slot, shape
        if self.renderer is not None:
            self.renderer.render(frames, rngs, pixels)
            return out
        for f, rng, dest in zip(frames, rngs, pixels):
            self.transform.into(f, rng, dest)
        return out

    def __iter__(self):
        info = get_worker_info()
        self.worker = info.id if info else 0
        self.plan = self.plans[self.worker]
        if not self.plan["order"]:
            return iter(())
        pipeline = wds.DataPipeline(
            lambda: iter(self.plan["reads"]),
            lambda reads: _open_reads(reads, self.cache, self.lookahead, self.skip_bad),
            wds.tariterators.tar_file_expander,
            wds.tariterators.group_by_keys,
            lambda src: _tag(src, self.plan["expected"]),
            lambda src: _in_order(src, self.plan["order"]),
            *([_stand_ins] if self.skip_bad else []),
            wds.batched(self.batch_size, collation_fn=list, partial=False),
            wds.map(self._decode),
        )
        return _refusals_as_batches(pipeline) if info else iter(pipeline)


class ClipLoader:
    """Batches of one split for one rank; see the module docstring and ``shards.partition``.

    Every rank yields ``len(self)`` batches of exactly ``batch_size`` clips. With
    ``remainder="pad"`` the epoch is filled up by repeating clips (``valid`` False, not to be
    counted in evaluation); with ``"drop"`` the last partial global batch is left out (a
    different part each epoch). ``state_dict`` after k batches and ``load_state_dict`` in a
    new process continue the identical sequence; with another world size, worker count or
    batch size, the rest of the epoch is split anew, every remaining clip exactly once.

    Epochs: ``set_epoch(e)`` starts epoch e, or keeps the position in it when e is the current
    one (a resumed run stands mid-epoch, or at its end: see ``epoch_finished``); iterating
    after a finished epoch moves on to the next one.

    ``shuffle="node"`` (training): node-affine epochs (``shards.partition``): the ranks of a node
    (``local_size`` consecutive ranks, Horovod's and torchrun's placement) read only the shards,
    or pieces of shards, their node owns for the whole run, so a node cache (``cache_dir``)
    downloads each once per run, not every epoch. Through the cache, each worker asks for its
    copies in read order, ``lookahead`` ahead of its reading; the budget (``cache_budget``, one for
    every process using the directory) must hold ``local_size`` x workers x ``lookahead`` copies.
    The mode is this loader's, not the state's: a resumed epoch is split anew when it changes (its
    segments record their node counts).

    ``max_bad_samples``: 0 (the default) ends the iteration at the first bad sample; N goes on
    without up to N of them an epoch on this rank (counted from 0 again after ``load_state_dict``);
    None without any number, leaving the budget to the caller (see the module docstring).
    """

    def __init__(self, manifest, split: str, *, batch_size: int, rank: int | None = None,
                 world_size: int | None = None, train: bool = True, seed: int = 0, epoch: int = 0, num_workers: int = 2,
                 crop_size: int = 224, scale_size: int = 256, flip: bool = True,
                 shuffle_buffer: int = 256, remainder: str = "pad", eval_crops: int = 1,
                 cache_dir: str | None = None, cache_budget: int | str | None = None,
                 piece_samples: int | None = None, shuffle: str = "global", local_size: int | None = None,
                 lookahead: int = 2, decode_on_device: bool = False, shapes=None, direct_reads: str = "never",
                 modality: str = "rgb", max_bad_samples: int | None = 0):
        self.manifest = manifest if isinstance(manifest, Manifest) else load_manifest(manifest, direct_reads)
        self.split = split
        self.identity = self.manifest.identity  # what a saved position belongs to (``saved_on``)
        self.shards = self.manifest.splits[split].shards
        self.classes = self.manifest.classes
        rank, world_size, local_size = placement(rank, world_size, local_size)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.train, self.seed, self.num_workers = train, seed, num_workers
        self.remainder, self.piece_samples = remainder, piece_samples
        self.shuffle_buffer = shuffle_buffer if train else 0
        self.cache = ShardCache(cache_dir, cache_budget) if cache_dir else None
        if shuffle not in SHUFFLES:
            raise ValueError(f"shuffle must be one of {SHUFFLES}, not {shuffle!r}")
        if world_size % local_size:
            raise ValueError(f"world size {world_size} is not a whole number of nodes of {local_size} ranks")
        self.shuffle, self.local_size, self.lookahead = shuffle, local_size, lookahead
        self.decode_on_device = decode_on_device
        # multigrid (training only): shapes.batch_size(epoch) clips per batch, cut into shapes.parts(epoch)
        self.shapes = shapes if train else None
        if self.shapes:
            batch_size = self.batch_size = self.shapes.batch_size(epoch)
        self.transform = (TrainTransform(crop_size, scale_size, flip) if train
                          else EvalTransform(crop_size, scale_size, eval_crops))
        self.modality = modality
        if rank == 0 and (why := upsampling(self.manifest, self.transform)):
            warnings.warn(why, Upsampling, stacklevel=2)
        if modality == "motion":  # the clips' stored motion fields, with the geometry of their frames
            where = self.manifest.base or "the shard set"
            if self.manifest.motion == "none":
                raise UsageError(f"{where}: no motion fields for --modality motion; build the set with "
                                 "ingest build --motion mv (or flow)")
            if decode_on_device:
                raise UsageError("--decode-on-device: the motion fields of --modality motion are PNGs decoded on "
                                 "the CPU")
            self.transform = MotionTransform(self.transform, self.manifest.motion)
        elif modality != "rgb":
            raise ValueError(f"modality {modality!r} not rgb or motion")
        if not partition.per_rank(self.manifest.splits[split].num_samples, world_size, batch_size, remainder):
            raise ValueError(f"split {split!r} cannot fill one batch of {batch_size} on each of {world_size} "
                             "ranks; use remainder='pad'")
        self.epoch, self._past, self._done = epoch, [], 0
        self.max_bad_samples, self._bad = max_bad_samples, 0  # the budget, and the bad samples met this epoch
        self._clip_starts = None  # shard name -> its first clip's position in the split (made when needed)
        self._cached_order = None
        self.slots: SlotPool | None = None  # made at the first iteration, before workers fork
        self._slots_in_use = False

    def describe(self) -> str:
        """One line: what the loader reads and how it shuffles (the trainer logs it on rank 0, so a
        run's log says whether it really ran node-affine, and on how many nodes)."""
        what = f"{self.split}: {self.manifest.splits[self.split].num_samples} clips in {len(self.shards)} shards"
        if not self.train:
            return f"{what}, in stored order"
        if self._nodes == 1:
            alike = " (one node: the same as global)" if self.shuffle == "node" else ""
            return f"{what}, shuffle {self.shuffle}{alike}: one order of every shard for the {self.world_size} rank(s)"
        shares = partition.assign([s.num_samples for s in self.shards], self._nodes, self.seed)
        owned = sorted(len({r.shard for r in runs}) for runs in shares)
        clips = sorted(sum(r.size for r in runs) for runs in shares)
        return (f"{what}, shuffle node: {self._nodes} nodes of {self.local_size} rank(s), each reading only its "
                f"own shards for the whole run ({owned[0]}-{owned[-1]} shards, {clips[0]}-{clips[-1]} clips a node)")

    # --- position in the epoch -------------------------------------------------------------
    @property
    def _workers(self) -> int:
        return max(1, self.num_workers)

    @property
    def _nodes(self) -> int:
        """The orders the ranks split: one per node in the node-affine mode, else one."""
        return self.world_size // self.local_size if self.shuffle == "node" and self.train else 1

    def _segment(self) -> partition.Segment:
        return partition.Segment(self.world_size, self._workers, self.batch_size, self._done, self._nodes)

    def _orders(self) -> list[partition.Order]:
        """The orders the current segment partitions, one per node (the whole epoch unless resumed
        elastically)."""
        key = (self.epoch, self.seed, self.remainder, self.shuffle_buffer, self.piece_samples, tuple(self._past),
               self._nodes)
        if self._cached_order is None or self._cached_order[0] != key:
            base = partition.epoch_orders([s.num_samples for s in self.shards],
                                          self._past[0].nodes if self._past else self._nodes,
                                          self.seed, self.epoch, self.train, self.piece_samples)
            orders = partition.segment_orders(base, self._past, self.remainder, self.shuffle_buffer,
                                              self.seed, self.epoch, self._nodes)
            self._cached_order = (key, orders)
        return self._cached_order[1]

    def _lengths(self) -> tuple[int, ...]:
        return tuple(len(o) for o in self._orders())

    def _batches(self) -> int:
        return partition.batches_per_rank(self._lengths(), self.world_size, self.batch_size, self.remainder)

    def __len__(self) -> int:
        """Batches the next iteration yields on this rank: the rest of the epoch after a resume,
        the whole next epoch once this one is finished."""
        if self.epoch_finished:
            n = self.manifest.splits[self.split].num_samples
            batch = self.shapes.batch_size(self.epoch + 1) if self.shapes else self.batch_size
            return partition.batches_per_rank(n, self.world_size, batch, self.remainder)
        return self._batches() - self._done

    @property
    def epoch_finished(self) -> bool:
        """Every batch of the current epoch has been handed out."""
        return self._done >= self._batches()

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self._past, self._done, self._bad = epoch, [], 0, 0
            if self.shapes:
                self.batch_size = self.shapes.batch_size(epoch)

    def resize(self, batch_size: int) -> None:
        """Go on with ``batch_size`` clips per batch from here: the rest of the epoch is split anew
        (a new segment), every remaining clip exactly once (batch growth). Between iterations only."""
        state = self.state_dict()
        self.batch_size = batch_size
        if self.slots is not None and not self.slots.fits((batch_size, *self._clip_shape())):
            self.slots = None  # a new pool of larger slots at the next iteration
        self.load_state_dict(state)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "seed": self.seed, "world_size": self.world_size,
                "num_workers": self._workers, "batch_size": self.batch_size,
                "samples_consumed": self._done * self.batch_size,
                "segments": [asdict(s) for s in self._past + [self._segment()]],
                "remainder": self.remainder, "shuffle_buffer": self.shuffle_buffer,
                "piece_samples": self.piece_samples, "split": self.split,
                "identity": self.identity, "set": self.manifest.describe(),
                "fingerprint": self.manifest.fingerprint}

    def saved_on(self, state: dict) -> str | None:
        """The shard set a position (``state_dict``) was saved on, in words naming its identity,
        when it is not this loader's; None when it is. A state saved before sets had identities is
        matched by the inputs' fingerprint, all it holds (sets built from the same videos with
        other options pass that check)."""
        if "identity" in state:
            return None if state["identity"] == self.identity else set_title(state["identity"], state["set"])
        if state["fingerprint"] == self.manifest.fingerprint:
            return None
        return f"a shard set whose inputs' fingerprint is {state['fingerprint']} (saved before sets had identities)"

    def title(self) -> str:
        """This loader's set in words: its identity, what it holds and where."""
        return f"{set_title(self.identity, self.manifest.describe())} at {self.manifest.base or 'an unsaved manifest'}"

    def load_state_dict(self, state: dict) -> None:
        other = self.saved_on(state)
        if other:
            raise OtherShardSet(f"a loader position saved on {other} cannot continue on {self.title()}")
        if state["split"] != self.split:
            raise OtherShardSet(f"a loader position saved on split {state['split']!r} cannot continue on split "
                                f"{self.split!r}")
        self.epoch, self.seed = state["epoch"], state["seed"]
        if self.shapes:
            self.batch_size = self.shapes.batch_size(self.epoch)
        self.remainder, self.shuffle_buffer = state["remainder"], state["shuffle_buffer"]
        self.piece_samples = state["piece_samples"]
        segments = [partition.Segment(**s) for s in state["segments"]]
        self._bad = 0
        last = segments[-1]
        if (last.world_size, last.num_workers, last.batch_size, last.nodes) == (
                self.world_size, self._workers, self.batch_size, self._nodes):
            self._past, self._done = segments[:-1], last.batches_done
        else:
            self._past, self._done = segments, 0

    # --- reading ---------------------------------------------------------------------------
    def _plan(self, order: partition.Order, stream: partition.Stream, segment: int, skip: int = 0) -> dict:
        """What one worker reads (byte ranges, expected keys) and emits (local indices, in order),
        ``skip`` more of its batches left out (those a ``ClipDataset`` worker has made already)."""
        emitted = partition.emission(stream, self.shuffle_buffer, self.seed, self.epoch, segment)
        done = partition.worker_batches(self._done, self._workers, stream.worker) + skip
        todo = emitted[done * self.batch_size:]
        wanted = np.zeros(stream.size, dtype=bool)
        wanted[todo] = True
        reads, expected, local = [], [], 0
        for run in order.slice(stream.begin, stream.end):
            hits = np.flatnonzero(wanted[local: local + run.size])
            if len(hits):
                shard = self.shards[run.shard]
                a, b = run.start + int(hits[0]), run.start + int(hits[-1]) + 1
                end = shard.offsets[b - 1] + shard.lengths[b - 1]
                if reads and (reads[-1]["shard"], reads[-1]["end"]) == (run.shard, shard.offsets[a]):
                    reads[-1]["end"] = end  # runs that meet in the file (the order wraps inside a shard): one read
                else:
                    reads.append({"shard": run.shard, "start": shard.offsets[a], "end": end})
                expected += [(shard.keys[i], local + i - run.start if wanted[local + i - run.start] else None)
                             for i in range(a, b)]
            local += run.size
        return {"reads": reads, "expected": expected, "order": todo,
                "valid_locals": stream.valid_end - stream.begin}

    def _slot_pool(self) -> SlotPool | None:
        """The loader's pool of batch slots, or None where it cannot be used now: batches of JPEG
        bytes, or another iteration of this loader still running (slots belong to one at a time)."""
        if self.decode_on_device or self._slots_in_use:
            return None
        if self.slots is None:
            size = self.shapes.max_nbytes if self.shapes else self.batch_size * int(np.prod(self._clip_shape()))
            self.slots = SlotPool(self._workers, PREFETCH + 2, size)
        return self.slots

    def _clip_shape(self) -> tuple[int, ...]:
        """One clip's pixels, at the clip length ingest recorded (longer clips do without slots)."""
        return self.transform.shape(self.manifest.config.get("clip", {}).get("frames", 8))

    def _batch(self, sent: dict, pool: SlotPool | None, parts=None) -> dict:
        """A batch in the trainer's process from what a worker sent: pixels from its slot."""
        if "slot" in sent:
            sent["clips"] = pool.lease(sent.pop("slot"), sent.pop("shape"))
        elif "clips" in sent and pool is not None:
            pool.misses += 1
            if pool.misses == 1:
                log.info("batch slots: a batch came in memory of its own, all %d slots of its worker were "
                         "held (the caller keeps batches) or too small", pool.per_worker)
        if "clips" in sent and not parts:  # (parts: flat pixels, cut by shapes.unpack)
            sent["clips"] = sent["clips"].movedim(-1, -3)  # a view: channels-last memory
        return {**sent, "labels": torch.tensor(sent["labels"], dtype=torch.int64),
                "videos": [video_id(k) for k in sent["keys"]],
                "valid": torch.tensor(sent["valid"], dtype=torch.bool)}

    def _count_bad(self, found: list[dict]) -> None:
        """What a batch left out, completed with where it is (its clip in the split, this rank) and
        counted; past ``max_bad_samples`` this epoch: ``TooManyBadSamples``."""
        if not found:
            return
        if self._clip_starts is None:
            self._clip_starts = dict(zip((s.name for s in self.shards),
                                         np.cumsum([0] + [s.num_samples for s in self.shards]).tolist()))
        for record in found:
            record |= {"split": self.split, "clip": self._clip_starts[record["shard"]] + record["index"],
                       "rank": self.rank}
        self._bad += len(found)
        if self.max_bad_samples is not None and self._bad > self.max_bad_samples:
            last = CorruptSample.of(**{k: found[-1][k] for k in CorruptSample.FACTS})
            raise TooManyBadSamples(f"{self._bad} bad samples in epoch {self.epoch + 1} of {self.split} on rank "
                                    f"{self.rank}, more than max_bad_samples={self.max_bad_samples}; the last: {last}")

    def _pieces(self) -> list[dict[int, tuple[int, int]]]:
        """What each node's cache holds of each shard it owns (node-affine): the byte range of its
        samples there, when that is not the whole shard; one dict per node."""
        if self._nodes == 1:
            return [{}]
        out = []
        for runs in partition.assign([s.num_samples for s in self.shards], self._nodes, self.seed):
            out.append({})
            for run in runs:
                shard = self.shards[run.shard]
                if run.size < shard.num_samples:
                    out[-1][run.shard] = (shard.offsets[run.start],
                                          shard.offsets[run.stop - 1] + shard.lengths[run.stop - 1])
        return out

    def _largest_copy(self, pieces: list[dict[int, tuple[int, int]]]) -> int:
        """The largest copy any rank of the job may ask its cache for this epoch: the same number on
        every rank, so that a budget too small for it is refused by every rank or by none (a rank
        refusing alone would leave the others in a collective). Whole shards wherever a node owns
        one whole, or reads one (global mode; after the node count changed), else pieces."""
        if self._nodes == 1 or any(seg.nodes != self._nodes for seg in self._past):
            return max(s.bytes for s in self.shards)
        split = {i for node in pieces for i in node}
        return max([end - start for node in pieces for start, end in node.values()]
                   + [s.bytes for i, s in enumerate(self.shards) if i not in split])

    def _piece(self, read: dict, pieces: dict[int, tuple[int, int]]) -> Piece:
        """The cached copy a read comes from: the node's piece of the shard if it holds the read
        (it may not, for the rest of an epoch after the node count changed), else the whole shard."""
        shard = self.shards[read["shard"]]
        start, end = pieces.get(read["shard"], (0, None))
        if not (start <= read["start"] and (end is None or read["end"] <= end)):
            start, end = 0, None
        return Piece(self.manifest.shard_url(shard), shard.sha256, shard.bytes, start, end)

    def _worker_plans(self, skips: dict[int, int] | None = None) -> tuple[list[dict], int]:
        """Every DataLoader worker's plan for the rest of the epoch, its reads complete with where
        they read from and what they are checked against (``fd`` None: opened by the worker), and
        the node whose order they are in. ``skips``: batches more to leave out, by worker."""
        orders, lengths, segment = self._orders(), self._lengths(), len(self._past)
        streams = partition.streams(lengths, self.world_size, self.rank, self._workers,
                                    self.batch_size, self.remainder)
        order = orders[streams[0].node]
        # DataLoader worker i makes batches done+i, done+i+W, ...: those of stream (done+i) % W
        plans = [self._plan(order, streams[(self._done + i) % self._workers], segment, (skips or {}).get(i, 0))
                 for i in range(self._workers)]
        node = streams[0].node
        pieces = self._pieces() if self.cache else None
        for r in (r for p in plans for r in p["reads"]):
            shard = self.shards[r["shard"]]
            r["url"], r["size"], r["sha256"] = self.manifest.shard_url(shard), shard.bytes, shard.sha256
            r["shard_info"], r["fd"] = shard, None  # sizes, digests: every sample checked as read
            if pieces is not None:
                r["piece"] = self._piece(r, pieces[node])
        if pieces is not None:  # refuse before downloading anything if the node's readers cannot fit
            largest, ahead = self._largest_copy(pieces), max(1, self.lookahead)
            self.cache.reserve(self.local_size * self._workers * ahead * largest,
                               f"the lookahead of this node's {self.local_size} ranks x {self._workers} loader "
                               f"workers x {ahead} shards of up to {largest:,} bytes")
        return plans, node

    def __iter__(self):
        if self.epoch_finished:
            self.set_epoch(self.epoch + 1)
        lengths, segment = self._lengths(), len(self._past)
        plans, _ = self._worker_plans()
        parts = self.shapes.parts(self.epoch) if self.shapes else None
        steps = partition.step_samples(lengths, self._segment(), self.remainder, self.shuffle_buffer,
                                       self.seed, self.epoch, segment, parts and tuple(p.clips for p in parts))
        reads = [r for p in plans for r in p["reads"]]
        local = {r["shard"]: r["url"] for r in reads if local_path(r["url"]) is not None and not self.cache}
        fds, pool, batches = {}, None, None
        try:
            if len(local) <= SHARED_FDS_MAX:
                fds = {i: open_fd(u) for i, u in local.items()}
            for r in reads:
                r["fd"] = fds.get(r["shard"])
            pool = self._slot_pool()
            self._slots_in_use |= pool is not None
            renderer = parts and PartsRenderer(parts, self.transform.crop_size, self.transform.scale_size,
                                               self.transform.flip, self.manifest.motion if self.modality == "motion"
                                               else None)
            dataset = _Streams(plans, self.transform, self.batch_size, self.seed, self.epoch,
                               self.decode_on_device, pool, renderer, self.cache, self.lookahead,
                               skip_bad=self.max_bad_samples != 0)
            loader = DataLoader(dataset, batch_size=None, num_workers=self.num_workers,
                                multiprocessing_context="fork" if self.num_workers else None,
                                prefetch_factor=PREFETCH if self.num_workers else None,
                                pin_memory=torch.cuda.is_available() and pool is None,
                                worker_init_fn=_leave_stop_signals_to_the_trainer)
            batches = iter(loader)
            for sent, global_valid in zip(batches, steps, strict=True):
                if isinstance(sent, CommandError):  # a worker's refusal (_refusals_as_batches)
                    raise sent
                self._count_bad(sent.get("bad", []))
                self._done += 1
                batch = self._batch(sent, pool, parts) | {"global_valid": global_valid}
                yield unpack(batch, parts) if parts else batch
        finally:
            if pool is not None:
                getattr(batches, "_shutdown_workers", lambda: None)()  # no worker writes a slot any more
                pool.reclaim()
                self._slots_in_use = False
            for fd in fds.values():
                os.close(fd)
