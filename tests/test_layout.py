"""The layout planner: recommendation, opens counted on the partition plan, the CLI. Its counts
against the real loader's metadata operations: ``test_metadata_ops``."""
import json

from helpers.shardsets import make_shardset

from shards.cli import main
from shards.plan import layout

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
    p = layout.plan(KINETICS, 6144, 8, 8, [1, 1536, 6144])
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
    # the rows asked for, no more
    assert [r["world_size"] for r in p["rows"]] == [1, 1536] and p["set"] is None
    assert main(["plan", "--clips", "240000", "--max-world-size", "100", "--json"]) == 0
    assert [r["world_size"] for r in json.loads(capsys.readouterr().out)["rows"]] == [1, 8, 64, 100]


def rows(block: str) -> list[int]:
    """The world sizes of a text table's rows."""
    return [int(line.split()[0]) for line in block.splitlines() if "|" in line and line.split()[0].isdigit()]


def test_plan_of_a_set_tables_its_own_layout_then_the_recommendation(tmp_path, capsys):
    """Before: `shards plan SET` tabled only a recommended layout, and added a 6,144-rank row to
    --world-sizes 1,2,4."""
    make_shardset(str(tmp_path), {"train": 23}, per_shard=8)  # 8 + 8 + 7 clips
    assert main(["plan", str(tmp_path), "--world-sizes", "1,2,4"]) == 0
    out = capsys.readouterr().out
    own, _, recommended = out.partition("Recommended:")
    assert ("This set: 3 shards of 7-8 clips" in own
            and own.index("This set") < out.index("Recommended: 1 shard of"))
    assert rows(own) == [1, 2, 4] and rows(recommended.split("ops =")[0]) == [1, 2, 4]
    assert "6,144" not in out and "6144" not in out
    opens = {int(line.split()[0]): line.split("|")[1].split()[0] for line in own.splitlines()
             if "(max" in line}
    assert opens[1] == "3.00"  # one rank opens the set's 3 shards; the recommended single shard, once
    assert main(["plan", str(tmp_path), "--world-sizes", "1,2", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["set"]["num_shards"] == 3 and p["set"]["shard_clips"] == [7, 8] and p["num_shards"] == 1
    assert p["set"]["rows"][0]["shards"]["opens_per_rank_max"] == 3
    assert p["rows"][0]["shards"]["opens_per_rank_max"] == 1
    assert main(["plan", str(tmp_path), "--num-shards", "2", "--world-sizes", "1"]) == 0
    assert "Planned (--num-shards): 2 shards of ~12 clips" in capsys.readouterr().out
