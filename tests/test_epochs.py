"""The epoch planner (``trainer.data.epochs``) under both loaders: ``ClipDataset`` under torchdata's
``StatefulDataLoader`` yields the ready loader's sequence with as many workers (each worker reads a stream
of its own, so the order depends on their count, every clip once whatever it is) and resumes the
identical sequence wherever it is stopped (after any batch, at an epoch's end with its iterator exhausted
or not, one batch into the next epoch) with 1, 2 and 4 workers."""
from __future__ import annotations

import pytest
from helpers.shardsets import make_shardset

CLIPS, BATCH = 21, 4  # 6 batches an epoch on one rank, the last padded with 3 repeats
BATCHES = -(-CLIPS // BATCH)


@pytest.fixture(scope="module")
def shardset(tmp_path_factory):
    d = tmp_path_factory.mktemp("set")
    make_shardset(str(d), {"train": CLIPS}, per_shard=5)
    return str(d)


def loader(shardset, workers: int):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from trainer.data import ClipDataset

    dataset = ClipDataset(shardset, "train", batch_size=BATCH, frames="jpeg", seed=5, shuffle_buffer=8)
    return StatefulDataLoader(dataset, batch_size=BATCH, num_workers=workers, collate_fn=ClipDataset.collate)


def rows(batch) -> list[tuple[str, bool]]:
    return list(zip(batch["keys"], batch["valid"].tolist()))


def epochs(shardset, workers: int, count: int = 2) -> list[list[tuple[str, bool]]]:
    whole = loader(shardset, workers)
    return [rows(b) for _ in range(count) for b in whole]


def stopped(shardset, workers: int, after: int, exhausted: bool) -> list[list[tuple[str, bool]]]:
    """``after`` batches read (``exhausted``: and the epoch's iterator run to its end), the state saved;
    then a new loader given the state reads on to the end of the second epoch."""
    first = loader(shardset, workers)
    out, batches = [], iter(first)
    for _ in range(after):
        try:
            out.append(rows(next(batches)))
        except StopIteration:  # into the next epoch
            batches = iter(first)
            out.append(rows(next(batches)))
    if exhausted:
        assert next(batches, None) is None
    state = first.state_dict()
    del batches, first
    again = loader(shardset, workers)
    again.load_state_dict(state)
    out += [rows(b) for b in again]  # the rest of the epoch it was stopped in (none when exhausted: the next)
    if after <= BATCHES and not exhausted:
        out += [rows(b) for b in again]  # the next one
    return out


STOPS = [(after, False) for after in range(1, BATCHES + 2)] + [(BATCHES, True)]


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_a_stateful_dataloader_resumes_the_identical_sequence_wherever_it_is_stopped(shardset, workers):
    from trainer.data import ClipLoader, EpochOptions

    whole = epochs(shardset, workers)
    ready = ClipLoader(shardset, "train", EpochOptions(batch_size=BATCH, seed=5, shuffle_buffer=8),
                       num_workers=workers, crop_size=32, scale_size=40)
    assert whole == [rows(b) for _ in range(2) for b in ready]
    for epoch in (whole[:BATCHES], whole[BATCHES:]):
        assert len({k for b in epoch for k, valid in b if valid}) == CLIPS
        assert sum(not valid for b in epoch for _, valid in b) == BATCHES * BATCH - CLIPS
    assert whole[:BATCHES] != whole[BATCHES:]  # a new order
    wrong = [(after, exhausted) for after, exhausted in STOPS
             if stopped(shardset, workers, after, exhausted) != whole]
    assert not wrong, f"{workers} worker(s): another sequence after stopping at (batches, exhausted) {wrong}"


def test_a_dataset_position_saved_on_another_layout_is_refused_in_one_line(shardset):
    from trainer.data import ClipDataset

    dataset = ClipDataset(shardset, "train", batch_size=BATCH, frames="jpeg", seed=5)
    rows = iter(dataset)
    for _ in range(BATCH):  # one batch (a state counts whole batches)
        next(rows)
    state = dataset.state_dict()
    assert state["worker_batches"] == 1
    other = ClipDataset(shardset, "train", batch_size=BATCH, frames="jpeg", seed=5, rank=0, world_size=2)
    with pytest.raises(ValueError) as refused:
        other.load_state_dict(state)
    assert "\n" not in str(refused.value) and str(refused.value).startswith(
        "a ClipDataset position saved with 1 DataLoader worker(s), 1 rank(s) and batches of 4 cannot "
        "continue with 1, 2 and 4"), refused.value
    same = ClipDataset(shardset, "train", batch_size=BATCH, frames="jpeg", seed=5)
    same.load_state_dict(state)
    assert [r["keys"] for r in same] == [r["keys"] for r in rows]


def test_the_trainers_configs_name_loader_options_and_its_refusals_are_worded_as_flags(shardset):
    import dataclasses
    import inspect

    from shards.base.errors import UsageError
    from trainer import config
    from trainer.data import ClipLoader
    from trainer.data.arguments import (
        FROM_CONFIG,
        LOADER_FROM_CONFIG,
        PLANNER_FROM_CONFIG,
        loader_kwargs,
        worded_as_flags,
    )
    from trainer.data.epochs import EpochOptions

    assert set(PLANNER_FROM_CONFIG.values()) <= {f.name for f in dataclasses.fields(EpochOptions)}
    assert set(LOADER_FROM_CONFIG.values()) <= set(inspect.signature(ClipLoader).parameters) - {"epochs"}
    fields = {f.name for c in (config.Data, config.Evaluation) for f in dataclasses.fields(c)}
    assert set(FROM_CONFIG) <= fields
    data = config.Data(data=shardset, crop_size=64, scale_size=32, val_split="", workers=0)
    with pytest.raises(UsageError) as refused, worded_as_flags(data):
        planning, reading = loader_kwargs(data)
        ClipLoader(shardset, "train", EpochOptions(**planning, train=False),
                   **reading)  # evaluation: scale below crop
    assert str(refused.value).startswith("--scale-size=32 is smaller than --crop-size=64: evaluation scales "
                                         "the short side to --scale-size"), refused.value
