"""The layout planner: recommendation, opens counted on the partition plan, the CLI. Its counts
against the real loader's metadata operations: ``test_metadata_ops``."""
import json

from shards import layout
from shards.cli import main
from shardsets import make_shardset

KINETICS = layout.Totals(clips=240_000, clip_bytes=150e3, frames=8)


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
    text = layout.format_plan(p)
    assert "Trade-off" in text and "6,144 ranks" in text


def test_plan_cli_from_totals_and_from_manifest(tmp_path, capsys):
    assert main(["plan", "--clips", "240000", "--clip-size", "150kB", "--world-sizes", "1,1536",
                 "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert [r["world_size"] for r in p["rows"]] == [1, 1536, 6144]
    make_shardset(str(tmp_path), {"train": 23}, per_shard=5)
    assert main(["plan", str(tmp_path), "--max-world-size", "16", "--world-sizes", "1,2,4"]) == 0
    out = capsys.readouterr().out
    assert "Recommended: 1 shard of" in out and "23 clips" in out
