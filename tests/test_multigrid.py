"""The multigrid schedule: the reference implementation's numbers, the rules, and its iterations."""
from __future__ import annotations

import pytest

from shards.plan.partition import per_rank
from trainer.data.shapes import clip_frames
from trainer.schedules.multigrid import Schedule, Shape, plan, step_lr

# SlowFast's MultigridSchedule (slowfast/utils/multigrid.py) on its own multigrid config,
# configs/Kinetics/SLOWFAST_8x8_R50_stepwise_multigrid.yaml: 32 frames, 224 crop, lr steps at
# epochs 0, 94, 154, 196 of 239, gamma 0.1, long and short cycles, EPOCH_FACTOR 1.5. Its
# schedule is [(stage, [B factor, T, S], end epoch), ...] and it sets SOLVER.STEPS, SOLVER.LRS
# (relative rates) and SOLVER.MAX_EPOCH as below; ShortCycleBatchSampler multiplies the batch of
# successive iterations by round((S / (f * 224))²) for f = 1/2, 1/√2, then 1.
REFERENCE = {"epochs": 239, "stages": (94, 154, 196), "frames": 32, "crop": 224}
REFERENCE_SCHEDULE = [
    (0, [8, 8, 158], 73), (0, [4, 16, 158], 110), (0, [2, 16, 224], 142), (0, [1, 32, 224], 158),
    (1, [8, 8, 158], 205), (1, [4, 16, 158], 228), (1, [2, 16, 224], 248), (1, [1, 32, 224], 259),
    (2, [8, 8, 158], 291), (2, [4, 16, 158], 308), (2, [2, 16, 224], 322), (2, [1, 32, 224], 329),
    (3, [1, 32, 224], 358)]
REFERENCE_STEPS = [0, 73, 110, 142, 158, 205, 228, 248, 259, 291, 308, 322, 329, 343]
REFERENCE_LRS = [8.0, 4.0, 2.0, 1.0, 0.8, 0.4, 0.2, 0.1, 0.08, 0.04, 0.02, 0.01, 0.01, 0.001]
REFERENCE_MAX_EPOCH = 358
# the sampler's successive per-GPU batch multipliers and crops, per long-cycle shape (B, T, S)
REFERENCE_SHORT_CYCLES = {(8, 8, 158): ((16, 8, 8), (112, 158, 158)),
                          (4, 16, 158): ((8, 4, 4), (112, 158, 158)),
                          (2, 16, 224): ((8, 4, 2), (112, 158, 224)),
                          (1, 32, 224): ((4, 2, 1), (112, 158, 224))}
# short cycle alone: SOLVER.STEPS and MAX_EPOCH scaled by EPOCH_FACTOR
REFERENCE_SHORT_ONLY_STEPS, REFERENCE_SHORT_ONLY_MAX_EPOCH = [0, 141, 231, 294], 358


def test_long_and_short_cycles_reproduce_the_reference_schedule():
    phases = plan(**REFERENCE)
    assert [p.start for p in phases] == REFERENCE_STEPS
    assert phases[-1].end == REFERENCE_MAX_EPOCH
    assert [step_lr(p) for p in phases] == pytest.approx(REFERENCE_LRS)
    # the reference lists the final phase once; here it is two phases, one per learning rate
    ours = [(p.stage, [p.shape.factor, p.shape.frames, p.shape.crop], p.end) for p in phases]
    assert ours[:-2] == REFERENCE_SCHEDULE[:-1]
    assert ours[-1] == REFERENCE_SCHEDULE[-1] and ours[-2][1] == REFERENCE_SCHEDULE[-1][1]
    for p in phases:
        factors, crops = REFERENCE_SHORT_CYCLES[(p.shape.factor, p.shape.frames, p.shape.crop)]
        assert tuple(s.factor for s in p.cycle) == factors
        assert tuple(s.crop for s in p.cycle) == crops
        assert {s.frames for s in p.cycle} == {p.shape.frames}


# the reference's end epochs (its final_schedule) for odd baseline epoch counts, where 1.5x is a
# half-integer and the final phase's length is decided by floating-point rounding: stages are the
# reference config's scaled (trainer.schedules.regime.stages_for), 8 frames, 224 crop; and one with
# even stages of 121 epochs
ODD_EPOCHS = {
    (43, (17, 28, 35)): [13, 20, 26, 29, 37, 42, 45, 47, 53, 55, 58, 59, 65],
    (81, (32, 52, 66)): [25, 38, 48, 54, 70, 77, 84, 88, 99, 104, 109, 111, 121],
    (121, (30, 60, 90)): [25, 37, 48, 53, 78, 90, 101, 106, 131, 143, 154, 159, 181],
    (143, (56, 92, 117)): [44, 66, 85, 94, 122, 136, 149, 155, 174, 184, 192, 197, 214],
    (149, (59, 96, 122)): [46, 69, 89, 99, 128, 142, 155, 161, 182, 192, 201, 205, 224],
    (163, (64, 105, 134)): [50, 75, 96, 107, 139, 155, 169, 176, 199, 210, 220, 225, 245],
}


@pytest.mark.parametrize("epochs, stages", list(ODD_EPOCHS))
def test_odd_epoch_counts_end_where_the_reference_ends(epochs, stages):
    phases = plan(epochs, stages, 8, 224)
    ends = [p.end for p in phases]
    assert ends[:-2] + ends[-1:] == ODD_EPOCHS[epochs, stages]


def test_short_cycle_alone_scales_the_stages_like_the_reference():
    phases = plan(**REFERENCE, long_cycle=False)
    assert [p.start for p in phases] == REFERENCE_SHORT_ONLY_STEPS
    assert phases[-1].end == REFERENCE_SHORT_ONLY_MAX_EPOCH
    assert [step_lr(p) for p in phases] == pytest.approx([1, 0.1, 0.01, 0.001])
    assert all(p.cycle == (Shape(32, 112, 4), Shape(32, 158, 2), Shape(32, 224, 1)) for p in phases)


def test_long_cycle_alone_ends_at_the_full_shape():
    # (the reference raises IndexError here)
    phases = plan(**REFERENCE, short_cycle=False)
    assert all(len(p.cycle) == 1 for p in phases)
    assert [p.shape for p in phases[:4]] == [Shape(8, 158, 8), Shape(16, 158, 4), Shape(16, 224, 2),
                                             Shape(32, 224, 1)]
    assert phases[-1].shape == phases[-2].shape == Shape(32, 224, 1)
    assert phases[-1].end == round(239 * 1.5)
    # equal iterations per long-cycle shape within a stage: epochs in proportion to the batch factor,
    first = phases[:4]
    iterations = [(p.end - p.start) / p.shape.factor for p in first]
    assert max(iterations) - min(iterations) <= 1  # whole epochs: at most one epoch of the full shape apart


def test_without_cycles_the_plan_is_the_baseline():
    phases = plan(**REFERENCE, long_cycle=False, short_cycle=False)
    assert [(p.start, p.end, p.stage) for p in phases] == [(0, 94, 0), (94, 154, 1), (154, 196, 2),
                                                           (196, 239, 3)]
    assert all(p.cycle == (Shape(32, 224, 1),) for p in phases)


@pytest.mark.parametrize("frames,crop", [(8, 224), (16, 112), (32, 224)])
def test_every_shape_costs_the_pixels_of_the_base_batch(frames, crop):
    """B·T·S² constant across long-cycle shapes and, with their batches, across short-cycle crops
    (up to the rounding of S to whole pixels)."""
    base = frames * crop * crop
    for p in plan(100, (40, 65, 85), frames, crop):
        for s in (p.shape, *p.cycle):
            assert s.factor * s.frames * s.crop**2 == pytest.approx(base, rel=0.02), s
    shapes = {p.shape for p in plan(100, (40, 65, 85), frames, crop)}
    assert {(s.frames * 4 // frames, s.factor) for s in shapes} == {(1, 8), (2, 4), (2, 2), (4, 1)}


def test_bad_stage_boundaries_are_refused():
    with pytest.raises(ValueError, match="increase strictly"):
        plan(10, (5, 5), 8, 224)
    with pytest.raises(ValueError, match="increase strictly"):
        plan(10, (10,), 8, 224)
    with pytest.raises(ValueError, match="two learning-rate stages"):
        plan(10, (), 8, 224)


SMALL = {"epochs": 12, "stages": (5, 9), "frames": 8, "crop": 64}


@pytest.mark.parametrize("world_size,batch,samples,remainder", [(1, 2, 50, "pad"), (2, 2, 50, "pad"),
                                                                 (3, 1, 97, "drop"), (4, 3, 200, "pad")])
def test_iterations_follow_the_plan_and_read_each_epoch_once(world_size, batch, samples, remainder):
    phases = plan(**SMALL)
    sched = Schedule(phases, batch, world_size, samples, remainder)
    assert sched.epochs == phases[-1].end == round(12 * 1.5)
    steps = [sched.at(i) for i in range(sched.total)]
    assert [s.iteration for s in steps] == list(range(sched.total))
    clips = 0
    for epoch in range(sched.epochs):
        phase = sched.epoch_phase[epoch]
        mine = [s for s in steps if s.epoch == epoch]
        assert [s.index for s in mine] == list(range(len(mine)))
        # successive iterations walk through the cycle, small crops (big batches) first
        assert [s.shape for s in mine] == [phase.cycle[i % len(phase.cycle)] for i in range(len(mine))]
        assert all(s.batch == batch * s.shape.factor and s.lr_factor == phase.shape.factor for s in mine)
        # the epoch is whole periods, each a loader batch of the same size on every rank
        period = sum(batch * s.factor for s in phase.cycle)
        assert len(mine) == per_rank(samples, world_size, period, remainder) // period * len(phase.cycle)
        for s in mine:  # the learning-rate clock counts global clips
            assert s.clips == clips
            clips += s.batch * world_size
        assert clips - mine[0].clips == mine[0].epoch_clips
        if remainder == "drop":
            assert mine[0].epoch_clips <= samples
        else:
            assert samples <= mine[0].epoch_clips < samples + world_size * period
    positions = [sched.position(s) for s in steps]
    assert (positions[0] == 0 and all(b > a for a, b in zip(positions, positions[1:]))
            and positions[-1] < sched.epochs)
    with pytest.raises(IndexError):
        sched.at(sched.total)


def test_schedule_refuses_an_epoch_too_small_for_one_period():
    with pytest.raises(ValueError, match="cannot fill one period"):
        Schedule(plan(**SMALL), batch=2, world_size=2, samples=50, remainder="drop")


@pytest.mark.parametrize("stored,frames,offset,expected", [
    (8, 8, 0, [0, 1, 2, 3, 4, 5, 6, 7]), (8, 4, 0, [0, 2, 4, 6]), (8, 4, 1, [1, 3, 5, 7]),
    (8, 2, 0, [0, 4]), (8, 2, 3, [3, 7]), (16, 4, 2, [2, 6, 10, 14])])
def test_shorter_clips_take_every_kth_stored_frame(stored, frames, offset, expected):
    assert clip_frames(stored, frames, offset) == expected


@pytest.mark.parametrize("stored,frames,offset", [(8, 3, 0), (8, 16, 0), (8, 4, 2), (8, 2, -1)])
def test_shorter_clips_refuse_uneven_strides_and_offsets(stored, frames, offset):
    with pytest.raises(ValueError):
        clip_frames(stored, frames, offset)
