"""Streaming clip loader: WebDataset shards -> uint8 batches (B, T, C, H, W), equal on every rank.

Who reads what, in which order, and where the loader stands in its epochs is decided by the epoch
planner, ``trainer.data.epochs`` (pure: ``shards.plan.partition`` and each worker's ``WorkerPlan`` of
``trainer.data.plan``, the position of ``trainer.data.position``), which ``ClipDataset`` holds too; the
pipeline's stages are the plain functions of ``trainer.data.stages``. ``ClipLoader`` is the I/O glue: it
holds the planner (``epochs``), asks it for an iteration's plans, runs the stages in its DataLoader
workers and hands their batches out. The data path of one loader worker, top to bottom:

    byte ranges of shards (one open each; local descriptors opened once by the rank and
    shared with its forked workers), every sample checked against the manifest's digest
    -> each sample at its manifest offset, parsed by the format's schema (``shards.format.sample``),
    tagged with its position in the plan -> release in the planned shuffled order
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
together (one optimizer step's, for the loss weights and the clips seen); ``waits``, (outages, seconds):
what the worker's reads waited for a source that was down since its previous batch.

With ``decode_on_device=True`` workers only parse JPEG headers and draw the crops: batches carry
the undecoded bytes and their geometry instead of ``clips``, for ``trainer.data.device_decode``.
With ``modality="motion"`` the clips are the samples' stored motion fields rendered with the
geometry their frames would get (``trainer.data.motion``): (B, T, 2, H, W), the rest alike.
With ``shapes`` (multigrid, ``trainer.data.shapes.EpochShapes``) an epoch's batches hold
``shapes.batch_size(epoch)`` clips, decoded as ``parts`` of their own shapes (fewer frames, smaller
crops; ``trainer.data.shapes``): the batch carries ``parts``, one batch per optimizer step, instead of ``clips``.

Bad samples (bytes that differ from the manifest's digest, read twice: ``shards.format.digests``): by
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

import logging
import os
import signal
from dataclasses import replace

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from shards.base.errors import CommandError, UsageError
from shards.format.digests import TooManyBadSamples
from shards.format.manifest import Manifest, set_title
from shards.format.sample import video_of
from shards.io.http_range import DEFAULT_RETRY, Retry
from shards.read import direct
from shards.read.cache import ShardCache
from shards.read.direct import load_manifest
from shards.read.reading import local_path, open_fd

from ..config import MODALITIES
from .arguments import Flag, Number, OneOf, Size, check, warn
from .epochs import EpochOptions, Epochs, OtherShardSet
from .motion import MotionTransform
from .plan import WorkerPlan, largest_copy, node_pieces
from .shapes import PartsRenderer, unpack
from .slots import SlotPool
from .stages import Decoding, decode_batch, ordered_samples, refusals_as_batches
from .transforms import EvalTransform, TrainTransform

log = logging.getLogger(__name__)

# A rank opens the local shards it reads once and its forked workers share the descriptors;
# above this many (small world sizes, where metadata load is no concern) workers open their own.
SHARED_FDS_MAX = 256
# Batches a DataLoader worker works ahead (its prefetch factor); the slot pool has two more per worker.
PREFETCH = 2
# ClipLoader's own arguments (the planner's are trainer.data.epochs.ARGUMENTS) and their rules
# (trainer.data.arguments), checked before anything is read; the split is one of the manifest's
ARGUMENTS = {"num_workers": Number(0), "crop_size": Number(1), "scale_size": Number(1), "flip": Flag(),
             "eval_crops": OneOf((1, 3)), "cache_budget": Size(), "lookahead": Number(0),
             "decode_on_device": Flag(), "direct_reads": OneOf(direct.MODES), "modality": OneOf(MODALITIES),
             "max_bad_samples": Number(0, none=True), "source_deadline": Number(0, kind=float, none=True)}


def shared_manifest(url: str, rank: int, broadcast, direct: str = "never", retry: Retry = DEFAULT_RETRY) -> Manifest:
    """Rank 0 reads the manifest (waiting for a source that is down as ``retry`` says); the others
    receive it via ``broadcast(obj, root_rank)``, e.g. ``horovod.torch.broadcast_object``.
    ``direct``: direct reads (``shards.read.direct``)."""
    return broadcast(load_manifest(url, direct, retry) if rank == 0 else None, 0)


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


class _Streams(IterableDataset):
    """The rank's streams; DataLoader worker i carries out ``plans[i]``: its ordered samples in batches,
    decoded (``trainer.data.stages``), each sample parsed as one of ``frames`` frames and ``motion``
    fields (``Manifest.frames``, ``Manifest.motion``)."""

    def __init__(self, plans: list[WorkerPlan], batch_size: int, how: Decoding, pool: SlotPool | None,
                 fds: dict[int, int], cache: ShardCache | None, lookahead: int, retry: Retry,
                 frames: int | None, motion: str):
        self.plans, self.batch_size, self.how, self.pool = plans, batch_size, how, pool
        self.fds, self.cache, self.lookahead, self.retry = fds, cache, lookahead, retry
        self.frames, self.motion = frames, motion

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info else 0
        plan = self.plans[worker]
        if not plan.order:
            return iter(())
        batches = wds.DataPipeline(
            lambda: iter(ordered_samples(plan, self.fds, self.cache, self.lookahead, self.how.skip_bad,
                                         self.retry, self.frames, self.motion)),
            wds.batched(self.batch_size, collation_fn=list, partial=False),
            wds.map(lambda samples: decode_batch(samples, plan, self.how, self.pool, worker)),
        )
        return refusals_as_batches(batches)


def planned(name: str) -> property:
    """The loader's view of its planner's ``name`` (``Epochs``), read-only."""
    return property(lambda self: getattr(self.epochs, name), doc=f"The planner's ``{name}``.")


class ClipLoader:
    """Batches of one split for one rank; see the module docstring and ``shards.plan.partition``.

    Every rank yields ``len(self)`` batches of exactly ``batch_size`` clips. With
    ``remainder="pad"`` the epoch is filled up by repeating clips (``valid`` False, not to be
    counted in evaluation); with ``"drop"`` the last partial global batch is left out (a
    different part each epoch). ``state_dict`` after k batches and ``load_state_dict`` in a
    new process continue the identical sequence; with another world size, worker count or
    batch size, the rest of the epoch is split anew, every remaining clip exactly once.

    ``train``: the training transform (TSM's random multi-scale crops and flips) and a shuffled order;
    None (the default) means True for the split named ``"train"`` and False for every other: the evaluation
    transform (``scale_size`` then a centre ``crop_size`` crop, or ``eval_crops=3``) in stored order.
    ``train=True`` augments any split.

    The options that decide the epochs are the planner's (``trainer.data.epochs.EpochOptions``), given as
    one object (``epochs``) or as keywords; the rest are the loader's own, how clips are read and decoded.
    Arguments are checked as the loader is made, before any shard is read (``ARGUMENTS`` here and in
    ``trainer.data.epochs``, ``trainer.data.arguments``): a wrong value is a ``ValueError`` naming the
    argument and what it may be (the split's: the manifest's splits; an evaluation ``scale_size`` below ``crop_size``), a value of the
    wrong type a ``TypeError``.

    Epochs: ``set_epoch(e)`` starts epoch e, or keeps the position in it when e is the current
    one (a resumed run stands mid-epoch, or at its end: see ``epoch_finished``); iterating
    after a finished epoch moves on to the next one.

    ``shuffle="node"`` (training): node-affine epochs (``shards.plan.partition``): the ranks of a node
    (``local_size`` consecutive ranks, Horovod's and torchrun's placement) read only the shards,
    or pieces of shards, their node owns for the whole run, so a node cache (``cache_dir``)
    downloads each once per run, not every epoch. Through the cache, each worker asks for its
    copies in read order, ``lookahead`` ahead of its reading; the budget (``cache_budget``, one for
    every process using the directory) must hold ``local_size`` x workers x ``lookahead`` copies.
    The mode is this loader's, not the state's: a resumed epoch is split anew when it changes (its
    segments record their node counts). Node-affine epochs are refused (``UsageError``) where the
    node shares would not hold the set's mix of classes (``shards.plan.classmix``: a set stored in class
    or source order), or with ``shuffle_fallback`` (``--shuffle auto``) replaced by global ones,
    said in one log line.

    ``max_bad_samples``: 0 (the default) ends the iteration at the first bad sample; N goes on
    without up to N of them an epoch on this rank (counted from 0 again after ``load_state_dict``);
    None without any number, leaving the budget to the caller (see the module docstring).

    A remote source that refuses connections, times out or answers 502/503/504 is waited for (the
    manifest read, every range, every cache download; ``shards.io.http_range``) for up to
    ``source_deadline`` seconds (None: ``$SHARD_SOURCE_DEADLINE``, else 10 minutes); past it the
    iteration raises ``shards.base.errors.SourceUnavailable`` at the batch that needed the bytes. That
    and every other ``shards.base.errors.DataFault`` (a ``CorruptSample``, a ``RangeError``) reach the
    caller as themselves, from loader workers too, with the loader's position at the batch before:
    ``state_dict`` then resumes at the batch that failed.
    """

    def __init__(self, manifest, split: str, epochs: EpochOptions | None = None, *, num_workers: int = 2,
                 crop_size: int = 224, scale_size: int = 256, flip: bool = True, eval_crops: int = 1,
                 cache_dir: str | None = None, cache_budget: int | str | None = None, lookahead: int = 2,
                 decode_on_device: bool = False, direct_reads: str = "never", modality: str = "rgb",
                 max_bad_samples: int | None = 0, source_deadline: float | None = None, **planning):
        """``epochs``: the planner's options (``trainer.data.epochs.EpochOptions``), or as keywords
        (``planning``: ``batch_size=8, seed=3, ...``); the rest, how the clips are read and decoded."""
        if epochs is not None and planning:
            raise TypeError(f"the planner's options in epochs or as keywords, not both: "
                            f"{', '.join(planning)}")
        options = EpochOptions(**planning) if epochs is None else epochs
        check(ARGUMENTS, locals())
        # a source that is down (refusing, timing out, 502/503/504) is waited for, up to this many seconds
        self.retry = Retry(deadline=source_deadline)
        self.manifest = manifest if isinstance(manifest, Manifest) else load_manifest(manifest, direct_reads,
                                                                                      self.retry)
        OneOf(tuple(self.manifest.splits))("split", split)
        self.split = split
        self.identity = self.manifest.identity  # what a saved position belongs to (``saved_on``)
        self.shards = self.manifest.splits[split].shards
        self.classes = self.manifest.classes
        rank, world_size, local_size = placement(options.rank, options.world_size, options.local_size)
        train = split == "train" if options.train is None else options.train
        if not train and eval_crops == 1 and scale_size < crop_size:
            raise ValueError(f"scale_size={scale_size} is smaller than crop_size={crop_size}: evaluation "
                             "scales the short side to scale_size, then cuts the centre crop: give "
                             f"scale_size {crop_size} or more")
        self.num_workers = num_workers
        placed = replace(options, rank=rank, world_size=world_size, local_size=local_size, train=train)
        self.epochs = Epochs(self.shards, split, placed, max(1, num_workers))
        self.cache = ShardCache(cache_dir, cache_budget, retry=self.retry) if cache_dir else None
        self.lookahead, self.decode_on_device = lookahead, decode_on_device
        self.transform = (TrainTransform(crop_size, scale_size, flip) if train
                          else EvalTransform(crop_size, scale_size, eval_crops))
        self.modality = modality
        if rank == 0 and (why := upsampling(self.manifest, self.transform)):
            warn(why, Upsampling)
        if modality == "motion":  # the clips' stored motion fields, with the geometry of their frames
            where = self.manifest.base or "the shard set"
            if self.manifest.motion == "none":
                raise UsageError(f"{where}: no motion fields for --modality motion; build the set with "
                                 "ingest build --motion mv (or flow)")
            if decode_on_device:
                raise UsageError("--decode-on-device: the motion fields of --modality motion are PNGs decoded on "
                                 "the CPU")
            self.transform = MotionTransform(self.transform, self.manifest.motion)
        self.max_bad_samples, self._bad = max_bad_samples, 0  # the budget, and the bad samples met this epoch
        self._clip_starts = None  # shard name -> its first clip's position in the split (made when needed)
        self.slots: SlotPool | None = None  # made at the first iteration, before workers fork
        self._slots_in_use = False

    def describe(self) -> str:
        """One line: what the loader reads and how it shuffles (the trainer logs it on rank 0, so a
        run's log says whether it really ran node-affine, and on how many nodes)."""
        return self.epochs.describe()

    # --- the epochs (trainer.data.epochs) ----------------------------------------------------------
    epoch, seed, remainder, batch_size = (planned(n) for n in ("epoch", "seed", "remainder", "batch_size"))
    rank, world_size, local_size = (planned(n) for n in ("rank", "world_size", "local_size"))
    train, shapes = planned("train"), planned("shapes")

    def __len__(self) -> int:
        """Batches the next iteration yields on this rank: the rest of the epoch after a resume,
        the whole next epoch once this one is finished."""
        return len(self.epochs)

    @property
    def epoch_finished(self) -> bool:
        """Every batch of the current epoch has been handed out."""
        return self.epochs.epoch_finished

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._bad = 0
        self.epochs.set_epoch(epoch)

    def resize(self, batch_size: int) -> None:
        """Go on with ``batch_size`` clips per batch from here: the rest of the epoch is split anew
        (a new segment), every remaining clip exactly once (batch growth). Between iterations only."""
        self.epochs.resize(batch_size)
        self._bad = 0
        if self.slots is not None and not self.slots.fits((batch_size, *self._clip_shape())):
            self.slots = None  # a new pool of larger slots at the next iteration

    def state_dict(self) -> dict:
        return {**self.epochs.state_dict(), "identity": self.identity, "set": self.manifest.describe(),
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
        self.epochs.load_state_dict(state)
        self._bad = 0

    # --- reading ---------------------------------------------------------------------------
    def _slot_pool(self) -> SlotPool | None:
        """The loader's pool of batch slots, or None where it cannot be used now: batches of JPEG
        bytes, or another iteration of this loader still running (slots belong to one at a time)."""
        if self.decode_on_device or self._slots_in_use:
            return None
        if self.slots is None:
            size = self.shapes.max_nbytes if self.shapes else self.batch_size * int(np.prod(self._clip_shape()))
            self.slots = SlotPool(self.epochs.workers, PREFETCH + 2, size)
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
                "videos": [video_of(k) for k in sent["keys"]],
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
            raise TooManyBadSamples(f"{self._bad} bad samples in epoch {self.epoch + 1} of {self.split} on rank "
                                    f"{self.rank}, more than max_bad_samples={self.max_bad_samples}; the last: "
                                    f"{found[-1]['line']}")

    def worker_plans(self, skips: dict[int, int] | None = None) -> list[WorkerPlan]:
        """The planner's plans of every DataLoader worker for the rest of the epoch (``Epochs.worker_plans``:
        ``skips``, batches more to leave out by worker), read from this set's URLs; with a node cache,
        refused first if the node's readers could not fit in its budget."""
        e = self.epochs
        pieces = node_pieces(self.shards, e.nodes, e.seed) if self.cache else None
        if pieces is not None:  # refuse before downloading anything if the node's readers cannot fit
            largest, ahead = largest_copy(self.shards, pieces, e.whole_shards), max(1, self.lookahead)
            self.cache.reserve(e.local_size * e.workers * ahead * largest,
                               f"the lookahead of this node's {e.local_size} ranks x {e.workers} loader "
                               f"workers x {ahead} shards of up to {largest:,} bytes")
        return e.worker_plans([self.manifest.shard_url(s) for s in self.shards], pieces, skips)

    def __iter__(self):
        if self.epoch_finished:
            self.set_epoch(self.epoch + 1)
        plans = self.worker_plans()
        parts = self.shapes.parts(self.epoch) if self.shapes else None
        steps = self.epochs.steps(parts and tuple(p.clips for p in parts))
        local = {} if self.cache else {r.shard: r.url for p in plans for r in p.reads if local_path(r.url) is not None}
        fds, pool, batches = {}, None, None
        try:
            if len(local) <= SHARED_FDS_MAX:
                fds = {i: open_fd(u) for i, u in local.items()}
            pool = self._slot_pool()
            self._slots_in_use |= pool is not None
            renderer = parts and PartsRenderer(parts, self.transform.crop_size, self.transform.scale_size,
                                               self.transform.flip, self.manifest.motion if self.modality == "motion"
                                               else None)
            how = Decoding(self.transform, self.seed, self.epoch, skip_bad=self.max_bad_samples != 0,
                           on_device=self.decode_on_device, renderer=renderer)
            streams = _Streams(plans, self.batch_size, how, pool, fds, self.cache, self.lookahead, self.retry,
                               self.manifest.frames, self.manifest.motion)
            loader = DataLoader(streams,
                                batch_size=None, num_workers=self.num_workers,
                                multiprocessing_context="fork" if self.num_workers else None,
                                prefetch_factor=PREFETCH if self.num_workers else None,
                                pin_memory=torch.cuda.is_available() and pool is None,
                                worker_init_fn=_leave_stop_signals_to_the_trainer)
            batches = iter(loader)
            for sent, global_valid in zip(batches, steps, strict=True):
                if isinstance(sent, CommandError):  # a refusal of the pipeline (stages.refusals_as_batches)
                    raise sent
                self._count_bad(sent.get("bad", []))
                self.epochs.position.done += 1
                batch = self._batch(sent, pool, parts) | {"global_valid": global_valid}
                yield unpack(batch, parts) if parts else batch
        finally:
            if pool is not None:
                getattr(batches, "_shutdown_workers", lambda: None)()  # no worker writes a slot any more
                pool.reclaim()
                self._slots_in_use = False
            for fd in fds.values():
                os.close(fd)
