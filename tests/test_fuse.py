"""``trainer test --fuse``: TSN's late fusion of two runs, checked against each run's own ``trainer test``.

Two tiny runs (a TSM and a TSN, trained at different crop sizes) are tested one by one, then fused:
the fused per-video scores must be the weighted mean of the two runs' own per-video softmax
scores, and the fused accuracy what those scores give. Three classes, so a video's top-5 scores
are all of its scores. Runs that do not score the same videos or classes are refused in one line.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.fusion import assert_fused, probabilities, report_of
from helpers.shardsets import make_shardset

from trainer import cli

NET = ["--backend", "none", "--segments", "4", "--depth", "10", "--width", "4", "--batch-size", "2",
       "--workers", "0", "--no-tensorboard", "--val-split", "", "--epochs", "1", "--warmup-epochs", "0",
       "--lr-per-8", "0.05"]
TEST = ["--backend", "none", "--workers", "0", "--batch-size", "3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A shard set (3 classes, 7 val clips of 4 videos, two clips each but the last) and two runs on it."""
    root = tmp_path_factory.mktemp("fuse")
    data = root / "data"
    make_shardset(str(data), {"train": 12, "val": 7}, per_shard=4, num_classes=3, frames=4, size=(48, 40))
    for name, flags in (("tsm", ["--crop-size", "24", "--scale-size", "28"]),
                        ("tsn", ["--no-shift", "--crop-size", "32", "--scale-size", "36", "--seed", "1"])):
        assert cli.main(["train", "--data", str(data), "--output-dir", str(root / name), *NET, *flags]) == 0
    return root, data


def test_fused_scores_are_the_weighted_mean_of_each_runs_own_scores(runs, capsys):
    root, data = runs
    classes = ["class0", "class1", "class2"]
    alone = [report_of(root / "report.json", "--checkpoint", str(root / name / "checkpoint.pt"),
                       "--data", str(data), *TEST) for name in ("tsm", "tsn")]
    capsys.readouterr()
    fused = report_of(root / "report.json", "--fuse", str(root / "tsm"), str(root / "tsn"),
                      "--weights", "1", "1.5", "--data", str(data), *TEST)
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line == fused["summary"]
    a, b = (probabilities(r["videos"], classes) for r in alone)
    assert a.keys() == b.keys() == {f"val_v{i:04d}" for i in range(4)}
    assert max((a[v] - b[v]).abs().max().item() for v in a) > 0.01  # two different networks
    assert_fused(fused, alone, [str(root / "tsm"), str(root / "tsn")], [1.0, 1.5], classes)
    assert fused["summary"]["video_top5"] == 100.0 and "clip_top1" not in fused["summary"]


def test_runs_must_score_the_same_videos_and_classes(runs, tmp_path, capsys):
    root, data = runs
    fewer = tmp_path / "fewer"  # the same clips but the last video's
    make_shardset(str(fewer), {"train": 12, "val": 6}, per_shard=4, num_classes=3, frames=4, size=(48, 40))
    fuse = ["test", "--fuse", str(root / "tsm"), str(root / "tsn"), *TEST]
    capsys.readouterr()
    assert cli.main([*fuse, "--data", str(data), str(fewer)]) == 1
    assert capsys.readouterr().err == (f"trainer test: error: --fuse: {root / 'tsn'} scores 3 videos, "
                                       f"{root / 'tsm'} 4; 1 are scored by only one of them (e.g. "
                                       f"val_v0003)\n")

    other = tmp_path / "other"
    shutil.copytree(root / "tsn", other)
    state = torch.load(other / "checkpoint.pt", weights_only=True)
    state["classes"] = ["a", "b", "c"]
    torch.save(state, other / "checkpoint.pt")
    assert cli.main(["test", "--fuse", str(root / "tsm"), str(other), *TEST, "--data", str(data)]) == 1
    assert capsys.readouterr().err == (f"trainer test: error: --fuse: {other} was trained on other classes "
                                       f"than {root / 'tsm'}\n")

    for argv, message in (
            ([*fuse, "--data", str(data), "--weights", "1"],
             "--weights: one per --fuse run (2), not all zero; got 1.0"),
            ([*fuse, "--data", str(data), "--weights", "0", "0"],
             "--weights: one per --fuse run (2), not all zero; got 0.0 0.0"),
            (["test", "--fuse", str(root / "tsm"), *TEST, "--data", str(data)],
             "--fuse: needs two runs or more, got 1"),
            ([*fuse, "--data", str(data), str(data), str(data)],
             "--data: one shard set for every run or one per run (2), got 3"),
            (["test", *TEST, "--data", str(data)], "give either --checkpoint or --fuse RUN_A RUN_B")):
        assert cli.main(argv) == 2
        assert capsys.readouterr().err.strip() == f"trainer test: error: {message}"
