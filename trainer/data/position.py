"""Where a loader stands in its epochs, and how a saved position continues under other settings.

An epoch is read in segments (``shards.plan.partition.Segment``): a stretch run with one world size, worker
count, batch size and node count, and the batches each rank has handed out in it. A position is the
epoch, the segments of it that ended (a job resumed elastically), and the batches done in the current one.
``Shuffle`` is what, besides the epoch, makes an epoch's order: the seed, the remainder policy, the
shuffle buffer and the piece size. A saved position (``state_dict``) continues the identical sequence
when the layout is the same, and otherwise ends its last segment there and splits the rest of the epoch
anew (``resume``): every remaining clip exactly once.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from shards.plan.partition import Segment


@dataclass(frozen=True)
class Shuffle:
    """What makes an epoch's order besides the epoch: saved with the position, taken from it on resume."""
    seed: int = 0
    remainder: str = "pad"  # pad the epoch with repeats to whole batches on every rank, or drop the rest
    shuffle_buffer: int = 256  # the bounded shuffle of each worker's stream (0: stored order)
    piece_samples: int | None = None  # shards cut into pieces of at most this many samples before ordering
    stored_clips: str = "each"  # every stored clip an epoch, or one of each video's (trainer.data.rotation)


@dataclass
class Position:
    """The epoch, its segments that ended, and the batches this rank handed out in the current one."""
    epoch: int = 0
    past: list[Segment] = field(default_factory=list)
    done: int = 0

    def start(self, epoch: int) -> None:
        """At the start of ``epoch``."""
        self.epoch, self.past, self.done = epoch, [], 0

    def segment(self, layout: Segment) -> Segment:
        """The current segment: ``layout``'s settings, with the batches done."""
        return replace(layout, batches_done=self.done)

    def state_dict(self, layout: Segment, shuffle: Shuffle) -> dict:
        """The position as plain data (with ``shuffle``'s fields, and the layout it was run with)."""
        return {"epoch": self.epoch, "seed": shuffle.seed, "world_size": layout.world_size,
                "num_workers": layout.num_workers, "batch_size": layout.batch_size,
                "samples_consumed": self.done * layout.batch_size,
                "segments": [asdict(s) for s in self.past + [self.segment(layout)]],
                **{f.name: getattr(shuffle, f.name) for f in fields(Shuffle) if f.name != "seed"}}

    @staticmethod
    def shuffle_of(state: dict) -> Shuffle:
        # a state saved before a field existed: the field's default
        return Shuffle(**{f.name: state.get(f.name, f.default) for f in fields(Shuffle)})

    @classmethod
    def resume(cls, state: dict, layout: Segment) -> "Position":
        """The position ``state`` saved, continued with ``layout`` (its ``batches_done`` ignored): the same
        sequence when the layout is the one saved, else the rest of the epoch as a new segment."""
        segments = [Segment(**s) for s in state["segments"]]
        last = segments[-1]
        if replace(last, batches_done=0) == replace(layout, batches_done=0):
            return cls(state["epoch"], segments[:-1], last.batches_done)
        return cls(state["epoch"], segments, 0)
