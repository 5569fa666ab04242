"""Streaming clip loader: WebDataset shards -> uint8 batches (B, T, C, H, W), equal on every rank.

Who reads what, in which order, and where the loader stands in its epochs is decided by the epoch
planner, ``trainer.data.epochs`` (pure: ``shards.plan.partition`` and each worker's ``WorkerPlan`` of
``trainer.data.plan``, the position of ``trainer.data.position``), which ``ClipDataset`` holds too; the
pipeline's stages are the plain functions of ``trainer.data.stages``. ``ClipLoader`` is the I/O glue: it
holds the planner (``epochs``), asks it for an iteration's plans, hands them to its worker processes, kept
from one iteration to the next (``trainer.data.workers``), which run the stages, and hands their batches
out (``trainer.data.batches``). The data path of one loader worker, top to bottom:

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
crops; ``trainer.data.shapes``): the batch carries ``parts``, one batch per optimizer step, instead of
``clips``.

Bad samples (bytes that differ from the manifest's digest): ``max_bad_samples`` and ``trainer.data.batches``.

The manifest is the only other thing read. Pass a ``Manifest`` object to avoid even that:
``shared_manifest`` lets rank 0 read it and broadcasts it over the job's collective (one
open per job instead of one per rank, at job start when every rank would hit the metadata
server at once); loader workers inherit it from the rank process.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from shards.base.errors import CommandError, UsageError
from shards.format.manifest import Manifest, set_title
from shards.io.http_range import Retry
from shards.read import direct
from shards.read.cache import ShardCache
from shards.read.direct import load_manifest
from shards.read.reading import local_path, open_fd

from ..config import MODALITIES
from .arguments import Flag, Number, OneOf, Size, check, warn
from .batches import BadSamples, received
from .epochs import EpochOptions, Epochs, OtherShardSet
from .motion import MotionTransform
from .placement import placement
from .plan import WorkerPlan, largest_copy, node_pieces
from .shapes import PartsRenderer, unpack
from .slots import SlotPool
from .stages import Decoding
from .transforms import EvalTransform, TrainTransform, Upsampling, upsampling
from .workers import PREFETCH, SHARED_FDS_MAX, Ticket, Workers

# ClipLoader's own arguments (the planner's are trainer.data.epochs.ARGUMENTS) and their rules
# (trainer.data.arguments), checked before anything is read; the split is one of the manifest's
ARGUMENTS = {"num_workers": Number(0), "crop_size": Number(1), "scale_size": Number(1), "flip": Flag(),
             "eval_crops": OneOf((1, 3)), "cache_budget": Size(), "lookahead": Number(0),
             "decode_on_device": Flag(), "direct_reads": OneOf(direct.MODES), "modality": OneOf(MODALITIES),
             "max_bad_samples": Number(0, none=True), "source_deadline": Number(0, kind=float, none=True)}


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

    ``epochs``: the options that decide the epochs, the planner's (``trainer.data.epochs.EpochOptions``);
    the keywords are the loader's own, how clips are read and decoded.
    Arguments are checked as the loader is made, before any shard is read (``ARGUMENTS`` here and in
    ``trainer.data.epochs``, ``trainer.data.arguments``): a wrong value is a ``ValueError`` naming the
    argument and what it may be (the split's: the manifest's splits; an evaluation ``scale_size`` below
    ``crop_size``), a value of the wrong type a ``TypeError``.

    Epochs: ``set_epoch(e)`` starts epoch e, or keeps the position in it when e is the current
    one (a resumed run stands mid-epoch, or at its end: see ``epoch_finished``); iterating
    after a finished epoch moves on to the next one. The ``num_workers`` worker processes serve one
    iteration after another (``trainer.data.workers``: when they are replaced); setting ``num_workers``
    between iterations splits the rest of the epoch anew among that many.

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

    def __init__(self, manifest, split: str, epochs: EpochOptions, *, num_workers: int = 2,
                 crop_size: int = 224, scale_size: int = 256, flip: bool = True, eval_crops: int = 1,
                 cache_dir: str | None = None, cache_budget: int | str | None = None, lookahead: int = 2,
                 decode_on_device: bool = False, direct_reads: str = "never", modality: str = "rgb",
                 max_bad_samples: int | None = 0, source_deadline: float | None = None):
        if not isinstance(epochs, EpochOptions):
            raise TypeError(f"epochs must be a trainer.data.EpochOptions, not {type(epochs).__name__} "
                            f"{epochs!r}")
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
        rank, world_size, local_size = placement(epochs.rank, epochs.world_size, epochs.local_size)
        train = split == "train" if epochs.train is None else epochs.train
        if not train and eval_crops == 1 and scale_size < crop_size:
            raise ValueError(f"scale_size={scale_size} is smaller than crop_size={crop_size}: evaluation "
                             "scales the short side to scale_size, then cuts the centre crop: give "
                             f"scale_size {crop_size} or more")
        placed = replace(epochs, rank=rank, world_size=world_size, local_size=local_size, train=train)
        self.epochs = Epochs(self.shards, split, placed, max(1, num_workers))
        self._num_workers = num_workers
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
                raise UsageError("--decode-on-device: the motion fields of --modality motion are PNGs "
                                 "decoded on the CPU")
            self.transform = MotionTransform(self.transform, self.manifest.motion)
        self.max_bad_samples = max_bad_samples
        # the budget, the bad samples met this epoch
        self.bad = BadSamples(max_bad_samples, split, self.shards)
        self.slots: SlotPool | None = None  # made at the first iteration, before workers fork
        self.processes: Workers | None = None  # forked at the first iteration, kept for the next ones

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

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @num_workers.setter
    def num_workers(self, workers: int) -> None:
        """Between iterations: the rest of the epoch split anew among ``workers`` (a new segment)."""
        ARGUMENTS["num_workers"]("num_workers", workers)
        state = self.epochs.state_dict()
        self.epochs.workers, self._num_workers = max(1, workers), workers
        self.epochs.load_state_dict(state)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.bad.met = 0
        self.epochs.set_epoch(epoch)

    def resize(self, batch_size: int) -> None:
        """Go on with ``batch_size`` clips per batch from here: the rest of the epoch is split anew
        (a new segment), every remaining clip exactly once (batch growth). Between iterations only."""
        self.epochs.resize(batch_size)
        self.bad.met = 0

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
        return (f"a shard set whose inputs' fingerprint is {state['fingerprint']} "
                "(saved before sets had identities)")

    def title(self) -> str:
        """This loader's set in words: its identity, what it holds and where."""
        where = self.manifest.base or "an unsaved manifest"
        return f"{set_title(self.identity, self.manifest.describe())} at {where}"

    def load_state_dict(self, state: dict) -> None:
        other = self.saved_on(state)
        if other:
            raise OtherShardSet(f"a loader position saved on {other} cannot continue on {self.title()}")
        self.epochs.load_state_dict(state)
        self.bad.met = 0

    # --- reading ---------------------------------------------------------------------------
    def _slot_pool(self) -> SlotPool | None:
        """The loader's pool of batch slots (a new one where the batches outgrew it or the worker count
        changed), or None for batches of JPEG bytes."""
        if self.decode_on_device:
            return None
        size = self.shapes.max_nbytes if self.shapes else self.batch_size * int(np.prod(self._clip_shape()))
        if self.slots is None or self.slots.workers != self.epochs.workers or size > self.slots.slot_bytes:
            self.slots = SlotPool(self.epochs.workers, PREFETCH + 2, size)
        return self.slots

    def _clip_shape(self) -> tuple[int, ...]:
        """One clip's pixels, at the clip length ingest recorded (longer clips do without slots)."""
        return self.transform.shape(self.manifest.config.get("clip", {}).get("frames", 8))

    def _workers_for(self, plans: list[WorkerPlan]) -> tuple[Workers, bool]:
        """The workers of this iteration, and whether they are the loader's own (kept for the next):
        those of the last iteration if they can serve it (``Workers.serve``), else new ones; while
        another iteration of this loader runs, workers of its own, without slots, ended with it."""
        if self.processes is not None and self.processes.busy:
            return self._new_workers(plans, None), False
        pool = self._slot_pool()
        if self.processes is not None and not self.processes.serve(self.num_workers, pool):
            self.processes.close()
            self.processes = None
        if self.processes is None:
            self.processes = self._new_workers(plans, pool)
        return self.processes, True

    def _new_workers(self, plans: list[WorkerPlan], pool: SlotPool | None) -> Workers:
        """Workers sharing the rank's descriptors of the local shards ``plans`` read (unless too many)."""
        local = {} if self.cache else {r.shard: r.url for p in plans for r in p.reads
                                       if local_path(r.url) is not None}
        fds = {i: open_fd(u) for i, u in local.items()} if len(local) <= SHARED_FDS_MAX else {}
        return Workers(self.num_workers, [*self.shards, self.transform], pool, fds, self.cache,
                       self.lookahead, self.retry, self.manifest.frames, self.manifest.motion)

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
        renderer = parts and PartsRenderer(parts, self.transform.crop_size, self.transform.scale_size,
                                           self.transform.flip,
                                           self.manifest.motion if self.modality == "motion" else None)
        how = Decoding(self.transform, self.seed, self.epoch, skip_bad=self.max_bad_samples != 0,
                       on_device=self.decode_on_device, renderer=renderer)
        workers, own = self._workers_for(plans)
        handed = 0
        try:
            batches = workers.run([Ticket(plan, self.batch_size, how) for plan in plans])
            for sent, global_valid in zip(batches, steps, strict=True):
                if isinstance(sent, CommandError):  # a refusal of the pipeline (stages.refusals_as_batches)
                    raise sent
                self.bad.count(sent.get("bad", []), self.epoch, self.rank)
                self.epochs.position.done += 1
                handed += 1
                batch = received(sent, workers.pool, parts) | {"global_valid": global_valid}
                yield unpack(batch, parts) if parts else batch
        finally:
            if own and handed == len(steps):  # every batch taken: no worker writes a slot any more
                workers.rest()
            else:
                workers.close()
                if own:
                    self.processes = None
