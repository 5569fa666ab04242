"""Mini-batch shapes in the loader: one loader batch of a multigrid epoch, cut into parts of their own shape.

A multigrid epoch (``trainer.schedules.multigrid.Schedule``) reads its clips in *periods*: one pass through
the short cycle, successive iterations of different crops and batch sizes (one iteration without
the short cycle). A rank's loader batch is one period, so ``shards.plan.partition`` still plans whole,
equal batches on every rank; this module describes and renders the period:

* ``Part(clips, frames, crop)``: one iteration's share of the loader batch. ``epoch_parts`` gives
  an epoch's parts from the schedule, the same on every rank (the schedule is a function of the
  epoch, never of anything rank-local).
* ``PartsRenderer`` (in a loader worker): clip i of the batch goes to the part it falls in. A part
  of T' < T frames takes every (T/T')-th stored frame from a random start below that stride
  (``clip_frames``): the same time span, a coarser grid, and only the frames taken are
  read and decoded. A part of crop c < S is TSM's multi-scale crop of the same field of view
  resized to c, decoded with its short side scaled by c/S as well (so JPEG's DCT scaling can skip
  the detail that resizing would throw away). All parts are written one after the other into one
  flat uint8 buffer (a slot of the loader's shared-memory pool).
* ``unpack`` (in the trainer's process): the flat buffer -> one batch per part, (B', T', C, c, c)
  views in channels-last memory like ordinary batches, with their labels, validity and real
  clips over all ranks (``shards.plan.partition.step_samples`` with ``parts``).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from .motion import MotionTransform
from .transforms import TrainTransform


@dataclass(frozen=True)
class Part:
    """``clips`` clips of ``frames`` x ``crop`` x ``crop`` pixels of ``channels`` each (3: RGB; 2: a
    motion field, ``trainer.data.motion``): one iteration of a loader batch."""
    clips: int
    frames: int
    crop: int
    channels: int = 3

    @property
    def clip_shape(self) -> tuple[int, int, int, int]:
        return self.frames, self.crop, self.crop, self.channels

    @property
    def nbytes(self) -> int:
        return self.clips * math.prod(self.clip_shape)


def epoch_parts(schedule, epoch: int, channels: int = 3) -> tuple[Part, ...]:
    """The parts of every loader batch of ``epoch``: one per shape of its phase's cycle."""
    phase = schedule.epoch_phase[epoch]
    return tuple(Part(schedule.batch * s.factor, s.frames, s.crop, channels) for s in phase.cycle)


def clip_frames(stored: int, frames: int, offset: int) -> list[int]:
    """Indices of the ``frames`` of a stored ``stored``-frame clip that a shorter clip takes: every
    (stored / frames)-th, starting at ``offset`` < that stride (training draws it; evaluation
    uses the full clip)."""
    if frames <= 0 or stored % frames:
        raise ValueError(f"cannot take {frames} of {stored} stored frames at a fixed stride")
    stride = stored // frames
    if not 0 <= offset < stride:
        raise ValueError(f"offset {offset} outside [0, {stride})")
    return list(range(offset, stored, stride))


def parts_nbytes(parts: tuple[Part, ...]) -> int:
    return sum(p.nbytes for p in parts)


class PartsRenderer:
    """Decodes one loader batch into its parts; ``crop_size`` and ``scale_size`` are those of the
    full shape, which the parts' own are scaled from; ``motion``: the kind of motion field rendered
    instead of the frames (``trainer.data.motion``), or None for RGB."""

    def __init__(self, parts: tuple[Part, ...], crop_size: int, scale_size: int, flip: bool,
                 motion: str | None = None):
        self.parts = parts
        self.transforms = [TrainTransform(p.crop, max(1, round(scale_size * p.crop / crop_size)), flip)
                           for p in parts]
        if motion:
            self.transforms = [MotionTransform(t, motion) for t in self.transforms]
        for part, transform in zip(parts, self.transforms):
            if part.channels != transform.channels:
                raise ValueError(f"parts of {part.channels} channels rendered as {transform.channels}")

    @property
    def clips(self) -> int:
        return sum(p.clips for p in self.parts)

    @property
    def nbytes(self) -> int:
        return parts_nbytes(self.parts)

    def render(self, frames: list[list[bytes]], rngs: list[random.Random], pixels: np.ndarray) -> None:
        """Clip i's stored frames ``frames[i]`` (its transform's ``members``; drawing from ``rngs[i]``)
        into the flat ``pixels``."""
        if len(frames) != self.clips:
            raise ValueError(f"a loader batch of {len(frames)} clips for parts of {self.clips}")
        clip, offset = 0, 0
        for part, transform in zip(self.parts, self.transforms):
            out = pixels[offset:offset + part.nbytes].reshape(part.clips, *part.clip_shape)
            for dest in out:
                stored, rng = frames[clip], rngs[clip]
                stride = len(stored) // part.frames
                start = rng.randrange(stride) if stride > 1 else 0
                transform.into([stored[k] for k in clip_frames(len(stored), part.frames, start)], rng, dest)
                clip += 1
            offset += part.nbytes


def unpack(batch: dict, parts: tuple[Part, ...]) -> dict:
    """A loader batch whose ``clips`` are the flat pixels of ``parts`` and whose ``global_valid`` is
    a count per part -> the batch with ``parts``: one batch per part, its ``clips`` a
    (B', T', C, c, c) view in channels-last memory, its ``labels``, ``valid``, ``keys`` and
    ``global_valid``."""
    flat, labels, valid = batch["clips"], batch["labels"], batch["valid"]
    out, clip, offset = [], 0, 0
    for part, global_valid in zip(parts, batch["global_valid"], strict=True):
        clips = flat[offset:offset + part.nbytes].view(part.clips, *part.clip_shape).movedim(-1, -3)
        out.append({"clips": clips, "labels": labels[clip:clip + part.clips],
                    "valid": valid[clip:clip + part.clips], "keys": batch["keys"][clip:clip + part.clips],
                    "global_valid": global_valid})
        clip, offset = clip + part.clips, offset + part.nbytes
    rest = {k: v for k, v in batch.items() if k != "clips"}
    return rest | {"parts": out, "global_valid": sum(batch["global_valid"])}


class EpochShapes:
    """What the loader needs of a multigrid schedule: each epoch's loader batch as parts, and the
    largest loader batch in bytes (the size of its shared-memory slots). ``schedule``: a
    ``trainer.schedules.multigrid.Schedule`` (read, never imported: the data room stands below the
    schedules); ``channels`` per pixel of the modality trained (``trainer.config.CHANNELS``)."""

    def __init__(self, schedule, channels: int = 3):
        self.schedule, self.channels = schedule, channels
        self.max_nbytes = max(parts_nbytes(epoch_parts(schedule, e, channels))
                              for e in range(schedule.epochs))

    def parts(self, epoch: int):
        return epoch_parts(self.schedule, min(epoch, self.schedule.epochs - 1), self.channels)

    def batch_size(self, epoch: int) -> int:
        return self.schedule.period(self.schedule.epoch_phase[min(epoch, self.schedule.epochs - 1)])
