"""The layout planner: recommendation, metadata-op model, and agreement with the real loader."""
import json
import os
from collections import Counter

import pytest

from shards import layout
from shards.cli import main
from shards.manifest import Manifest
from shardsets import make_shardset
from trainer.loader import ClipLoader

KINETICS = layout.Totals(clips=240_000, clip_bytes=150e3, frames=8)


def test_baseline_models_count_per_clip():
    f = layout.frame_folder_ops(1000, 8)
    assert (f.opens, f.stats, f.listings, f.total) == (8000, 1000, 0, 9000)
    assert layout.video_file_ops(1000).total == 2000


def test_recommendation_keeps_shards_large_but_bounded():
    count, per_shard = layout.recommend(KINETICS)
    assert 100 <= count <= 200 and 8e6 <= per_shard * KINETICS.clip_bytes <= 260e6
    assert layout.recommend(layout.Totals(100, 10e3)) == (1, 100)  # 1 MB in all: one shard
    assert layout.recommend(KINETICS, target_bytes=1e6)[0] == 4500  # never below 8 MB


def test_shard_opens_are_one_per_touched_shard():
    ranks, workers = layout.shard_opens([100] * 10, 1, 4, 5)
    assert ranks == [10] and workers[0] >= 10
    ranks, _ = layout.shard_opens([100] * 10, 40, 2, 5)
    assert all(1 <= r <= 2 for r in ranks) and len(ranks) == 40


def test_kinetics_plan_meets_the_issue_target():
    p = layout.plan(KINETICS, 6144, 8, 8, [1, 1536])
    rows = {r["world_size"]: r for r in p["rows"]}
    assert set(rows) == {1, 1536, 6144}
    assert rows[1536]["frame_folders_over_shards"] >= 500
    assert rows[6144]["shards"]["opens_per_rank_max"] <= 2
    assert rows[6144]["clips_per_rank"] == 40 and rows[1]["shards"]["opens_per_rank_max"] == p["num_shards"]
    assert all(r["shards"]["stats"] == 0 and r["shards"]["listings"] == 0 for r in p["rows"])
    text = layout.format_plan(p)
    assert "Trade-off" in text and "6,144 ranks" in text


@pytest.mark.parametrize("world_size,rank", [(3, 2), (7, 0)])
def test_predicted_opens_match_the_loader(tmp_path, monkeypatch, world_size, rank):
    d = str(tmp_path)
    make_shardset(d, {"train": 23}, per_shard=5)
    opened = Counter()
    real = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: (opened.update([path]), real(path, *a, **k))[1])
    ld = ClipLoader(d, "train", batch_size=2, rank=rank, world_size=world_size, num_workers=0,
                    crop_size=32, scale_size=48)
    opened.clear()
    list(ld)
    sizes = [s.num_samples for s in Manifest.load(d).splits["train"].shards]
    predicted, _ = layout.shard_opens(sizes, world_size, 1, 2)
    assert sum(opened.values()) == predicted[rank] and set(opened.values()) == {1}


def test_plan_cli_from_totals_and_from_manifest(tmp_path, capsys):
    assert main(["plan", "--clips", "240000", "--clip-size", "150kB", "--world-sizes", "1,1536",
                 "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert [r["world_size"] for r in p["rows"]] == [1, 1536, 6144]
    make_shardset(str(tmp_path), {"train": 23}, per_shard=5)
    assert main(["plan", str(tmp_path), "--max-world-size", "16", "--world-sizes", "1,2,4"]) == 0
    out = capsys.readouterr().out
    assert "Recommended: 1 shard of" in out and "23 clips" in out
