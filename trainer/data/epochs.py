"""The epoch planner under both loaders (``ClipLoader`` and ``ClipDataset``): pure, no I/O.

Given a split's shards (their manifest entries) and the planner's options (``EpochOptions``), ``Epochs``
decides, for one rank, everything about its epochs that is not reading:

1. the mode: global epochs (one order of every shard for all ranks), or node-affine ones (one order per
   node of the shards it owns, ``shards.plan.partition``) where the node shares hold the set's mix of classes
   (``shards.plan.classmix``, the verdict judged once, alike on every rank; refused in one line if not, or
   global with ``shuffle_fallback``);
2. the position (``trainer.data.position``): the epoch, its segments that ended, the batches done;
3. the orders the current segment partitions (``partition.epoch_orders``; with ``stored_clips="rotate"``
   only the one clip of each video the epoch reads, ``trainer.data.rotation``; ``segment_orders``) and
   their lengths, hence the batches of the epoch (``len``, ``epoch_finished``);
4. each loader worker's plan for the rest of the epoch (``worker_plans``: ``partition.streams``, the
   shuffle buffer's ``emission``, ``trainer.data.plan.worker_plan``) and each step's real clips over every
   rank (``steps``);
5. the state: a position as plain data (``state_dict``) and back (``load_state_dict``), exact with the same
   layout, else the rest of the epoch split anew; ``resize`` (batch growth) is a state re-read at another
   batch size.

The loaders carry out the plans (``trainer.data.loader``: descriptors, the node cache, slots, the
DataLoader, batches). The order depends on the inputs, the seed, the epoch and the layout (ranks, workers,
batch size); every clip the epoch reads (every stored clip, or with rotation one of each video's) is read
once whatever the layout.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace

from shards.base.errors import UsageError
from shards.base.words import plural
from shards.format.manifest import ShardInfo
from shards.plan import classmix, partition

from ..config import STORED_CLIPS
from .arguments import Flag, Number, OneOf, check
from .plan import WorkerPlan, worker_plan
from .position import Position, Shuffle
from .rotation import Rotation

log = logging.getLogger(__name__)

SHUFFLES = ("global", "node")  # one order for all ranks each epoch; or node-affine (shards.plan.partition)
# the planner's options and their rules (trainer.data.arguments); the seed is any int, ``shapes`` any
# ``trainer.data.shapes.EpochShapes``; the rank is checked below the world size once that is known
ARGUMENTS = {"batch_size": Number(1), "rank": Number(0, none=True), "world_size": Number(1, none=True),
             "local_size": Number(1, none=True), "train": Flag(none=True), "seed": Number(None),
             "epoch": Number(0), "shuffle_buffer": Number(0), "remainder": OneOf(partition.REMAINDERS),
             "piece_samples": Number(1, none=True), "shuffle": OneOf(SHUFFLES), "shuffle_fallback": Flag(),
             "stored_clips": OneOf(STORED_CLIPS)}


class OtherShardSet(UsageError, ValueError):
    """A position (``state_dict``) saved on another shard set or split than the loader reads:
    continuing it would read other clips in another order. The message names both sets."""


@dataclass(frozen=True)
class EpochOptions:
    """What decides a rank's epochs (``ClipLoader``'s docstring says what each does), checked as made
    (``ValueError`` or ``TypeError`` naming the option). ``rank``, ``world_size``, ``local_size`` and
    ``train`` may be None: the loader fills them in (``trainer.data.placement.placement``; ``train``: True
    for the split named ``"train"``)."""
    batch_size: int
    rank: int | None = None
    world_size: int | None = None
    local_size: int | None = None
    train: bool | None = None
    seed: int = 0
    epoch: int = 0
    shuffle_buffer: int = 256
    remainder: str = "pad"
    piece_samples: int | None = None
    shuffle: str = "global"
    shuffle_fallback: bool = False
    stored_clips: str = "each"  # training: every stored clip an epoch, or "rotate" one of each video's
    shapes: object = None  # multigrid (training only): shapes.batch_size(epoch) clips a batch

    def __post_init__(self):
        check(ARGUMENTS, {f.name: getattr(self, f.name) for f in fields(self)})


class Epochs:
    """One rank's epochs of one split (module docstring); ``options`` with the placement and ``train``
    filled in, ``workers``: the loader workers an epoch is split among (settable between iterations)."""

    def __init__(self, shards: list[ShardInfo], split: str, options: EpochOptions, workers: int = 1):
        o = options
        Number(0, o.world_size - 1)("rank", o.rank)
        if o.world_size % o.local_size:
            raise ValueError(f"world size {o.world_size} is not a whole number of nodes of {o.local_size} "
                             f"ranks")
        self.shards, self.split, self.workers = shards, split, workers
        self.rank, self.world_size, self.local_size, self.train = o.rank, o.world_size, o.local_size, o.train
        self.shuffle, self.shuffle_fallback = o.shuffle, o.shuffle_fallback
        self.shuffling = Shuffle(o.seed, o.remainder, o.shuffle_buffer if o.train else 0, o.piece_samples,
                                 o.stored_clips if o.train else "each")
        self._rotation: Rotation | None = None  # made when rotating
        self.shapes = o.shapes if o.train else None
        self.batch_size = self.shapes.batch_size(o.epoch) if self.shapes else o.batch_size
        if not partition.per_rank(self.clips_an_epoch, o.world_size, self.batch_size, o.remainder):
            raise ValueError(f"split {split!r} cannot fill one batch of {self.batch_size} on each of "
                             f"{o.world_size} ranks; use remainder='pad'")
        self.position = Position(o.epoch)
        self._mix: dict[tuple[int, int], classmix.Mix | None] = {}  # verdicts by (nodes, seed)
        self._cached_order = None  # (what the epoch's orders were made from, the orders)
        # judged at start: every rank alike
        if self.shuffle == "node" and self.train and o.world_size > o.local_size:
            self._mixed(o.world_size // o.local_size)

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    @property
    def rotation(self) -> Rotation | None:
        """Which stored clips each epoch reads when rotating (``trainer.data.rotation``), else None."""
        if self.shuffling.stored_clips == "rotate" and self._rotation is None:
            self._rotation = Rotation(self.shards)
        return self._rotation if self.shuffling.stored_clips == "rotate" else None

    @property
    def clips_an_epoch(self) -> int:
        """Clips a whole epoch reads: every stored clip, or with rotation one a video."""
        return self.rotation.videos if self.rotation else self.num_samples

    @property
    def epoch(self) -> int:
        return self.position.epoch

    @property
    def seed(self) -> int:
        return self.shuffling.seed

    @property
    def remainder(self) -> str:
        return self.shuffling.remainder

    # --- the mode --------------------------------------------------------------------------------
    @property
    def nodes(self) -> int:
        """The orders the ranks split: one per node in the node-affine mode (where the node shares
        hold the set's class mix, ``_mixed``), else one."""
        nodes = self.world_size // self.local_size if self.shuffle == "node" and self.train else 1
        return nodes if nodes == 1 or self._mixed(nodes) else 1

    def _mixed(self, nodes: int) -> bool:
        """Whether node-affine epochs on ``nodes`` nodes give every node the set's mix of classes
        (``shards.plan.classmix``; a set whose manifest lacks the labels is not judged, said once by rank 0).
        If not: refused with one line, or, with ``shuffle_fallback``, global epochs, said once by rank 0."""
        key = (nodes, self.seed)
        if key not in self._mix:
            shares = partition.assign([s.num_samples for s in self.shards], nodes, self.seed)
            labels = [s.labels for s in self.shards]
            mix = self._mix[key] = classmix.class_mix(labels, shares, self.seed)
            if mix is None and self.rank == 0:
                log.info("--shuffle %s: node-affine epochs on %d nodes, their class mix not judged (%s: %s)",
                         "auto" if self.shuffle_fallback else "node", nodes, self.split,
                         classmix.unjudged(labels, shares))
            if mix is not None and not mix.mixed:
                why = (f"node-affine epochs on {nodes} nodes would give them different classes for the whole "
                       f"run ({self.split}'s stored order follows the classes or the videos): "
                       f"{mix.describe()}")
                if not self.shuffle_fallback:
                    raise UsageError(f"--shuffle node: {why}; train with --shuffle global, or rebuild the "
                                     "set with ingest build (hashed order)")
                if self.rank == 0:
                    log.info("--shuffle auto: global epochs, not node-affine: %s", why)
        mix = self._mix[key]
        return mix is None or mix.mixed

    @property
    def whole_shards(self) -> bool:
        """Whether a node may read any shard whole this epoch: the global mode, or an epoch resumed after
        the node count changed (``plan.largest_copy``)."""
        return self.nodes == 1 or any(seg.nodes != self.nodes for seg in self.position.past)

    def describe(self) -> str:
        """One line: what the planner reads and how it shuffles."""
        what = f"{self.split}: {plural(self.num_samples, 'clip')} in {plural(len(self.shards), 'shard')}"
        if self.rotation:
            what += f", one of each video's an epoch ({plural(self.rotation.videos, 'video')}, rotating)"
        if not self.train:
            return f"{what}, in stored order"
        if self.nodes == 1:
            nodes = self.world_size // self.local_size
            alike = "" if self.shuffle == "global" else (" (one node: the same as global)" if nodes == 1 else
                                                         f" (on {nodes} nodes the shares would differ in "
                                                         "classes: global epochs instead)")
            return (f"{what}, shuffle {self.shuffle}{alike}: one order of every shard for the "
                    f"{self.world_size} rank(s)")
        shares = partition.assign([s.num_samples for s in self.shards], self.nodes, self.seed)
        owned = sorted(len({r.shard for r in runs}) for runs in shares)
        clips = sorted(sum(r.size for r in runs) for runs in shares)
        return (f"{what}, shuffle node: {self.nodes} nodes of {self.local_size} rank(s), each reading only "
                f"its own shards for the whole run ({owned[0]}-{owned[-1]} shards, {clips[0]}-{clips[-1]} "
                f"clips a node)")

    # --- orders and lengths ----------------------------------------------------------------------
    def layout(self) -> partition.Segment:
        """How the epoch is split now (a segment with no batches done)."""
        return partition.Segment(self.world_size, self.workers, self.batch_size, 0, self.nodes)

    def orders(self) -> list[partition.Order]:
        """The orders the current segment partitions, one per node (the whole epoch unless resumed
        elastically)."""
        p, o = self.position, self.shuffling
        made_of = (p.epoch, o, tuple(p.past), self.nodes)
        if self._cached_order is None or self._cached_order[0] != made_of:
            base = partition.epoch_orders([s.num_samples for s in self.shards],
                                          p.past[0].nodes if p.past else self.nodes,
                                          o.seed, p.epoch, self.train, o.piece_samples)
            if self.rotation:
                base = self.rotation.select(base, p.epoch)
            orders = partition.segment_orders(base, p.past, o.remainder, o.shuffle_buffer, o.seed, p.epoch,
                                              self.nodes)
            self._cached_order = (made_of, orders)
        return self._cached_order[1]

    def lengths(self) -> tuple[int, ...]:
        return tuple(len(o) for o in self.orders())

    def _batches(self) -> int:
        return partition.batches_per_rank(self.lengths(), self.world_size, self.batch_size, self.remainder)

    def epoch_batches(self, epoch: int) -> int:
        """Batches of a whole epoch ``epoch`` on this rank."""
        batch = self.shapes.batch_size(epoch) if self.shapes else self.batch_size
        return partition.batches_per_rank(self.clips_an_epoch, self.world_size, batch, self.remainder)

    def __len__(self) -> int:
        """Batches the next iteration yields on this rank: the rest of the epoch after a resume,
        the whole next epoch once this one is finished."""
        if self.epoch_finished:
            return self.epoch_batches(self.epoch + 1)
        return self._batches() - self.position.done

    @property
    def epoch_finished(self) -> bool:
        """Every batch of the current epoch has been handed out."""
        return self.position.done >= self._batches()

    def set_epoch(self, epoch: int) -> None:
        """At the start of ``epoch``, unless it is the current one (whose position is kept)."""
        if epoch != self.epoch:
            self.position.start(epoch)
            if self.shapes:
                self.batch_size = self.shapes.batch_size(epoch)

    def resize(self, batch_size: int) -> None:
        """Go on with ``batch_size`` clips per batch from here: the rest of the epoch is split anew
        (a new segment), every remaining clip exactly once (batch growth)."""
        state = self.state_dict()
        self.batch_size = batch_size
        self.load_state_dict(state)

    # --- plans ------------------------------------------------------------------------------------
    def worker_plans(self, urls: list[str], pieces: list[dict] | None = None,
                     skips: dict[int, int] | None = None) -> list[WorkerPlan]:
        """Every loader worker's plan for the rest of the epoch (``trainer.data.plan``), reading the
        shards at ``urls``; ``pieces``: the node caches' pieces (``plan.node_pieces``), when reading through
        one; ``skips``: batches more to leave out, by worker (those a ``ClipDataset`` worker has made)."""
        streams = partition.streams(self.lengths(), self.world_size, self.rank, self.workers, self.batch_size,
                                    self.remainder)
        node, o, done = streams[0].node, self.shuffling, self.position.done
        plans = []
        for i in range(self.workers):  # worker i makes batches done+i, done+i+W, ...: stream (done+i) % W
            stream = streams[(done + i) % self.workers]
            emitted = partition.emission(stream, o.shuffle_buffer, o.seed, self.epoch,
                                         len(self.position.past))
            skip = partition.worker_batches(done, self.workers, stream.worker) + (skips or {}).get(i, 0)
            plans.append(worker_plan(self.shards, urls, self.orders()[node], stream, emitted, skip,
                                     self.batch_size, None if pieces is None else pieces[node]))
        return plans

    def steps(self, parts: tuple[int, ...] | None = None) -> list:
        """The real clips of each remaining step over every rank (``partition.step_samples``); ``parts``:
        a multigrid batch's clips per part."""
        return partition.step_samples(self.lengths(), self.position.segment(self.layout()), self.remainder,
                                      self.shuffling.shuffle_buffer, self.seed, self.epoch,
                                      len(self.position.past), parts)

    # --- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {**self.position.state_dict(self.layout(), self.shuffling), "split": self.split}

    def load_state_dict(self, state: dict) -> None:
        """Continue the position ``state`` saved (``OtherShardSet`` if saved on another split)."""
        if state["split"] != self.split:
            raise OtherShardSet(f"a loader position saved on split {state['split']!r} cannot continue on "
                                f"split {self.split!r}")
        self.shuffling = Position.shuffle_of(state)
        if self.shapes:
            self.batch_size = self.shapes.batch_size(state["epoch"])
        self.position = Position.resume(state, self.layout())

    def same_layout(self, state: dict) -> bool:
        """Whether ``state`` was saved with this layout (ranks, workers, batch size, nodes)."""
        return replace(partition.Segment(**state["segments"][-1]), batches_done=0) == self.layout()
