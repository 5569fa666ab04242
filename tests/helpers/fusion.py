"""Test helper: ``trainer test`` reports (``--output``) read back, and the check that a ``--fuse``
report is TSN's late fusion of its runs' own reports (tests/test_fuse.py: two RGB runs;
tests/test_motion.py: an RGB and a motion stream)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer import cli


def report_of(path: Path, *argv: str) -> dict:
    """``trainer test ARGV --output PATH``, which must succeed; the report it wrote."""
    assert cli.main(["test", *argv, "--output", str(path)]) == 0
    return json.loads(path.read_text())


def probabilities(videos: dict, classes: list[str]) -> dict[str, torch.Tensor]:
    """Each video's scores by class index, from a report's top-5 lists (every class, with five or fewer)."""
    out = {}
    for video, entry in videos.items():
        assert sorted(entry["top5"]) == classes
        p = torch.zeros(len(classes))
        for name, score in zip(entry["top5"], entry["scores"]):
            p[classes.index(name)] = score
        out[video] = p
    return out


def assert_fused(fused: dict, alone: list[dict], runs: list[str], weights: list[float],
                 classes: list[str]) -> None:
    """``fused`` holds each run's own report (``alone``, in ``runs`` order) as its streams, and per
    video the ``weights``-weighted mean of their scores (within the reports' 5-digit rounding),
    with the video accuracy those scores give."""
    for stream, own, run in zip(fused["streams"], alone, runs):
        assert stream["run"] == run and stream["videos"] == own["videos"]
    for stream, own in zip(fused["summary"]["streams"], alone):
        assert {k: stream[k] for k in own["summary"] if k not in ("split", "crops")} == \
            {k: v for k, v in own["summary"].items() if k not in ("split", "crops")}
    each = [probabilities(r["videos"], classes) for r in alone]
    labels = {v: e["label"] for v, e in fused["videos"].items()}
    assert all(labels == {v: e["label"] for v, e in r["videos"].items()} for r in alone)
    mean = {v: sum(w * p[v] for w, p in zip(weights, each)) / sum(weights) for v in labels}
    for video, p in probabilities(fused["videos"], classes).items():
        assert torch.allclose(p, mean[video], atol=2e-5), video
    right = [mean[v].argmax().item() == labels[v] for v in labels]
    summary = fused["summary"]
    assert summary["video_top1"] == pytest.approx(100 * sum(right) / len(right))
    assert (summary["runs"], summary["weights"]) == (runs, weights)
