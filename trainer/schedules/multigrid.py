"""Multigrid training (Wu, Girshick, He, Feichtenhofer and Krähenbühl, CVPR 2020) on pre-sampled clips.

Baseline training gives every iteration the same mini-batch shape: B clips of T frames of S x S
pixels. Multigrid varies the shape on a schedule, keeping B·T·S² (the pixels in a mini-batch, so
the cost of an iteration) about constant and the learning rate linear in B. The schedule is a
pure function of a few numbers (no I/O), built in these steps:

1. Long cycle. Every learning-rate stage but the last cycles through the (T, S) factors
   (1/4, 1/√2), (1/2, 1/√2), (1/2, 1), (1, 1) (the paper's defaults), each shape with the batch
   factor round(T·S² / (t·s²)) = 8, 4, 2, 1 and the learning rate times that factor. Every shape
   of a stage gets the same number of iterations, so small shapes get more epochs.
2. Short cycle. Inside any long-cycle shape, successive iterations cycle through the crops
   S/2 and S/√2 of the *full* crop S, then the shape's own crop, the batch times
   round((own crop / crop)²) so that B·S² stays about constant. The learning rate stays that of
   the long-cycle shape (the reference implementation does not scale it either).
3. Final phase. The last stage runs at the full shape (still with the short cycle when it is on)
   for fewer epochs than the baseline's last stage: as many as give it the same iteration saving
   as the long-cycle stages. Its first half keeps the previous stage's rate (the reference's
   "fine-tuning phase"), its second half takes the last stage's.
4. Epochs. All phase lengths are scaled so that the run takes ``epoch_factor`` (1.5) times the
   baseline's epochs, then rounded on the running total: shapes change only at epoch boundaries.
5. Iterations (``Schedule``). Every epoch reads each clip once, in *periods* of one batch per
   short-cycle shape (one batch without the short cycle). A rank's loader batch is the period:
   ``periods`` of equal size per rank, so every rank runs the same iterations with the same shape
   at each, and ``shards.plan.partition`` splits and resumes the epoch unchanged.

With the long cycle alone, the reference implementation (SlowFast's ``slowfast/utils/multigrid.py``)
raises IndexError; here its final phase is simply the full shape. With the short cycle alone, the
stage boundaries and the epoch count are scaled by ``epoch_factor`` as the reference does.

Shorter clips come from the frames already stored (``trainer.data.shapes.clip_frames``): a shard's
clips hold the full T frames, one per segment of the video; T/2 takes every second of them and T/4
every fourth, so the clip spans the same time at a coarser temporal grid, and only the frames taken
are decoded.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate

from shards.plan.partition import batches_per_rank

LONG_CYCLE = ((1 / 4, 2**-0.5), (1 / 2, 2**-0.5), (1 / 2, 1.0), (1.0, 1.0))  # (T, S) factors
SHORT_CYCLE = (1 / 2, 2**-0.5)  # S factors of the full crop, before the long-cycle shape's own
EPOCH_FACTOR = 1.5  # the paper's default: 1.5x the baseline's epochs, still far fewer iterations


@dataclass(frozen=True)
class Shape:
    """One mini-batch shape: ``frames`` x ``crop`` x ``crop`` pixels per clip, ``factor`` x the base batch."""
    frames: int
    crop: int
    factor: int


@dataclass(frozen=True)
class Phase:
    """Epochs [start, end) at long-cycle shape ``shape`` (its factor also multiplies the learning rate),
    learning-rate stage ``stage``; successive iterations take the shapes of ``cycle`` in turn."""
    start: int
    end: int
    stage: int
    shape: Shape
    cycle: tuple[Shape, ...]


def batch_factor(frames: int, crop: float, t: int, s: float) -> int:
    """How many clips of t x s x s pixels cost as much as one of frames x crop x crop."""
    return max(1, round(frames * crop * crop / (t * s * s)))


def _cycle(base: Shape, full_crop: int, short_cycle: bool, short_factors) -> tuple[Shape, ...]:
    if not short_cycle:
        return (base,)
    shorter = tuple(Shape(base.frames, round(f * full_crop),
                          base.factor * max(1, round((base.crop / (f * full_crop)) ** 2)))
                    for f in short_factors)
    return (*shorter, base)


def plan(epochs: int, stages: tuple[int, ...], frames: int, crop: int, *, long_cycle: bool = True,
         short_cycle: bool = True, long_factors=LONG_CYCLE, short_factors=SHORT_CYCLE,
         epoch_factor: float = EPOCH_FACTOR) -> list[Phase]:
    """The phases of a run whose baseline is ``epochs`` epochs at ``frames`` x ``crop``, its learning
    rate stepping at the epochs ``stages`` (stage 0 starts at 0, stage i at ``stages[i - 1]``).
    See the module docstring; without either cycle, the baseline itself."""
    starts = [0, *stages]
    if any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= epochs:
        raise ValueError(f"stage boundaries {list(stages)} must increase strictly inside (0, {epochs})")
    full = Shape(frames, crop, 1)
    full_cycle = _cycle(full, crop, short_cycle, short_factors)
    if not long_cycle:
        factor = epoch_factor if short_cycle else 1
        ends = [int(b * factor) for b in starts[1:]] + [int(epochs * factor)]
        return [Phase(a, b, i, full, full_cycle) for i, (a, b) in enumerate(zip([0, *ends], ends))]
    if len(starts) < 2:
        raise ValueError("the long cycle needs at least two learning-rate stages "
                         "(it runs in all but the last)")
    cycles = []
    for ft, fs in long_factors:
        t, s = round(frames * ft), round(crop * fs)
        cycles.append(_cycle(Shape(t, s, batch_factor(frames, crop, t, s)), crop, short_cycle, short_factors))
    mean_factor = [sum(s.factor for s in c) / len(c) for c in cycles]
    spans = []  # (stage, cycle, epochs before scaling)
    iterations = 0.0  # of the long-cycle stages, in epochs at the base batch
    for stage, (a, b) in enumerate(zip(starts, starts[1:])):
        # equal iterations per shape: epochs in proportion to the shape's mean batch factor
        for c, m in zip(cycles, mean_factor):
            spans.append((stage, c, (b - a) * m / sum(mean_factor)))
            iterations += spans[-1][2] / m
    # iterations of the baseline per multigrid iteration, in the reference's order (baseline iterations
    # over the sum above): equal to the mean batch factor in exact arithmetic, but not in floating
    # point, where it can move the rounded end of the final phase by an epoch (81 epochs: 121, not 122)
    saving = starts[-1] / iterations
    final = (epochs - starts[-1]) / saving * (sum(s.factor for s in full_cycle) / len(full_cycle))
    spans.append((len(starts) - 1, full_cycle, final))
    scale = epochs * epoch_factor / sum(e for _, _, e in spans)
    ends = [round(total) for total in accumulate(e * scale for _, _, e in spans)]
    phases = [Phase(a, b, stage, c[-1], c) for (stage, c, _), a, b in zip(spans, [0, *ends], ends)]
    last = phases.pop()
    middle = (last.start + last.end) // 2
    return phases + [Phase(last.start, middle, last.stage - 1, last.shape, last.cycle),
                     Phase(middle, last.end, last.stage, last.shape, last.cycle)]


def step_lr(phase: Phase, gamma: float = 0.1) -> float:
    """The reference's step schedule: ``gamma`` per stage, times the long-cycle batch factor."""
    return gamma ** phase.stage * phase.shape.factor


@dataclass(frozen=True)
class Step:
    """What global iteration ``iteration`` trains on, the same on every rank."""
    iteration: int
    epoch: int
    index: int  # iteration within the epoch
    shape: Shape  # frames, crop and factor of this iteration's batch
    batch: int  # clips per rank
    lr_factor: int  # the long-cycle batch factor the learning rate is multiplied by
    stage: int
    clips: int  # global clips of all earlier iterations (the learning-rate clock)
    epoch_clips: int  # global clips one epoch of this phase reads (padding included)


class Schedule:
    """A plan expanded to iterations for a run of ``world_size`` ranks with base batch ``batch``
    clips per rank, over a split of ``samples`` clips (``remainder`` as in ``shards.plan.partition``)."""

    def __init__(self, phases: list[Phase], batch: int, world_size: int, samples: int,
                 remainder: str = "pad"):
        self.phases, self.batch, self.world_size = phases, batch, world_size
        self.epoch_phase = [p for p in phases for _ in range(p.start, p.end)]
        self.iterations, self.global_clips = [], []
        for p in self.epoch_phase:
            period = self.period(p)
            periods = batches_per_rank(samples, world_size, period, remainder)
            if not periods:
                raise ValueError(f"{samples} clips cannot fill one period of {period} clips on "
                                 f"{world_size} ranks")
            self.iterations.append(periods * len(p.cycle))
            self.global_clips.append(periods * period * world_size)
        self.first = [0, *accumulate(self.iterations)]  # first iteration of each epoch, then the total
        self.clips_before = [0, *accumulate(self.global_clips)]

    @property
    def epochs(self) -> int:
        return len(self.epoch_phase)

    @property
    def total(self) -> int:
        return self.first[-1]

    def period(self, phase: Phase) -> int:
        """Clips per rank in one pass through ``phase``'s cycle: the loader's batch in that phase."""
        return sum(self.batch * s.factor for s in phase.cycle)

    def at(self, iteration: int) -> Step:
        if not 0 <= iteration < self.total:
            raise IndexError(f"iteration {iteration} outside the schedule's {self.total}")
        epoch = bisect_right(self.first, iteration) - 1
        phase = self.epoch_phase[epoch]
        index = iteration - self.first[epoch]
        periods, j = divmod(index, len(phase.cycle))
        clips = self.clips_before[epoch] + self.world_size * (
            periods * self.period(phase) + sum(self.batch * s.factor for s in phase.cycle[:j]))
        shape = phase.cycle[j]
        return Step(iteration, epoch, index, shape, self.batch * shape.factor, phase.shape.factor,
                    phase.stage, clips, self.global_clips[epoch])

    def position(self, step: Step) -> float:
        """Epochs done before ``step``, fractional: what epoch-based learning-rate rules read."""
        return step.epoch + (step.clips - self.clips_before[step.epoch]) / step.epoch_clips

