"""Batch growth: the set points, Smith et al.'s decay rule, and the gradient noise scale estimate."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from helpers.shardsets import make_shardset

from trainer import metrics
from trainer.schedules.batch_growth import (
    LocalGradNorm,
    NoiseScale,
    batch_at_points,
    batch_for_decay,
    batch_for_noise,
    grad_sq_norm,
    lr_multiplier,
    noise_terms,
)
from trainer.schedules.recipe import warmup_cosine


def test_set_points_double_the_batch_up_to_the_cap():
    points = (10, 20, 30)
    assert [batch_at_points(e, 64, points, 256) for e in (0, 9.9, 10, 19, 20,
                                                          35)] == [64, 64, 128, 128, 256, 256]
    assert batch_at_points(35, 64, points, 10_000) == 512


def test_growing_instead_of_decaying_keeps_the_rate_and_the_noise_of_the_schedule():
    """Smith et al.: where a cosine schedule decays, the batch grows instead; the rate stays within
    a factor 2 of the peak until the batch reaches its cap, and rate/batch (the noise scale) is the
    schedule's at every step."""
    base, cap, total, warmup = 32, 512, 1000, 50
    batches, rates = [], []
    for step in range(warmup, total):
        m = warmup_cosine(step, warmup, total)
        batch = batch_for_decay(m, base, cap)
        batches.append(batch)
        rates.append(lr_multiplier(m, batch, base))
        assert rates[-1] / batch == pytest.approx(m / base)
        assert batch & (batch - 1) == 0 and base <= batch <= cap
    assert batches == sorted(batches) and batches[0] == base and batches[-1] == cap
    capped = batches.index(cap)
    assert all(0.5 < r <= 1 for r in rates[:capped])
    assert rates[-1] < 0.01  # past the cap the schedule decays as before
    assert batch_for_decay(0.0, base, cap) == cap


def per_example_gradients(n: int = 4096, dim: int = 20, seed: int = 0) -> torch.Tensor:
    """Gradients of a least-squares loss at a fixed point, one row per example."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g, dtype=torch.float64)
    y = x @ torch.randn(dim, generator=g,
                        dtype=torch.float64) + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
    w = torch.zeros(dim, dtype=torch.float64) + 0.3
    return (x @ w - y).unsqueeze(1) * x


def test_noise_scale_estimate_matches_the_true_one_from_per_example_gradients():
    """Ranks see batches of 16 of a data set whose true B_simple = tr(Σ)/|G|² is known from its
    per-example gradients; the estimate from the two batch sizes every data-parallel step has
    (one rank's, the average's) lands near it."""
    grads = per_example_gradients()
    mean = grads.mean(0)
    true = ((grads - mean).square().sum(1).mean() / mean.square().sum()).item()
    ranks, local = 4, 16
    g = torch.Generator().manual_seed(1)
    estimate = NoiseScale(decay=0.99)
    for _ in range(2000):
        idx = torch.randint(0, len(grads), (ranks, local), generator=g)
        rank_means = grads[idx].mean(1)
        small = rank_means.square().sum(1).mean().item()
        big = rank_means.mean(0).square().sum().item()
        estimate.update(small, local, big, ranks * local)
    assert estimate.value == pytest.approx(true, rel=0.1)


def test_noise_terms_are_exact_for_known_norms():
    # |G|² = 1, tr Σ = 8: E|G_B|² = |G|² + tr Σ / B
    g2, trace = noise_terms(1 + 8 / 4, 4, 1 + 8 / 16, 16)
    assert g2 == pytest.approx(1) and trace == pytest.approx(8)
    with pytest.raises(ValueError):
        noise_terms(1, 8, 1, 8)


def test_noise_scale_state_round_trips_and_starts_unknown():
    n = NoiseScale()
    assert math.isinf(n.value)
    n.update(3.0, 4, 1.5, 16)
    m = NoiseScale()
    m.load_state_dict(n.state_dict())
    assert m.value == n.value == pytest.approx(8)


def test_noise_scale_doubles_the_batch_only_while_it_is_larger():
    assert batch_for_noise(64, 200.0, 1024) == 128
    assert batch_for_noise(64, 60.0, 1024) == 64
    assert batch_for_noise(512, 5000.0, 1000) == 512


def test_local_gradient_norm_hooks_see_each_backward_once():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    norms = LocalGradNorm(model.parameters())
    model(torch.randn(7, 5)).square().sum().backward()
    assert norms.pop() == pytest.approx(grad_sq_norm(model.parameters()), rel=1e-6)
    assert norms.pop() == 0.0
    norms.remove()
    model(torch.randn(7, 5)).sum().backward()
    assert norms.pop() == 0.0


def test_trainer_grows_the_batch_mid_epoch_with_the_rate_and_reads_every_clip_once(tmp_path):
    """``trainer train --batch-growth points`` on one process: the batch doubles where the clips
    seen cross each point (mid-epoch, where the loader splits the rest of the epoch anew, and at
    an epoch's end), the rate doubles with it, and each epoch trains on every clip once."""
    data, out = tmp_path / "data", tmp_path / "run"
    make_shardset(str(data), {"train": 40}, per_shard=7, frames=4, size=(48, 40))
    run = subprocess.run([sys.executable, "-m", "trainer", "train", "--backend", "none", "--data", str(data),
                          "--output-dir", str(out), "--val-split", "", "--segments", "4", "--depth", "10",
                          "--width", "8", "--crop-size", "32", "--scale-size", "36", "--batch-size", "2",
                          "--epochs", "2", "--warmup-epochs", "0", "--lr-per-8", "0.05", "--workers", "1",
                          "--print-freq", "100", "--no-tensorboard", "--batch-growth", "points",
                          "--growth-points", "0.5", "1", "--trace-steps"],
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = metrics.read(str(out / "steps-rank0.jsonl"))
    rates = []
    for s in steps:  # the batch each step trained on follows the points, in real clips seen before it
        assert s["batch"] == (2 if s["seen"] < 20 else 4 if s["seen"] < 40 else 8), s
        rates.append(s["lr"] / warmup_cosine(s["seen"], 0, 80))  # the cosine taken out: peak x B/B0
    assert rates == pytest.approx([0.0125 * s["batch"] / 2 for s in steps])
    epochs = metrics.read(str(out / "metrics.jsonl"))
    assert [(r["clips"], r["step"]) for r in epochs if r["event"] == "epoch"] == [(40, 15), (80, 20)]
    assert "batch growth (points): 2 -> 4" in run.stderr
