"""Precise BN: running statistics equal the population statistics of the batches, at the full shape.

``recompute`` on a tiny TSM is checked against PyTorch's own BN: each batch's mean and unbiased
variance (a forward with momentum 1) combined by the law of total variance, for every layer, and
the first layer also against its input computed by hand. A ``trainer train --multigrid short
--precise-bn 2`` run (two of three iterations at smaller crops) then saves a checkpoint whose
first BN layer holds the statistics of the first two full-shape training batches of its last epoch.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import torch
from helpers.shardsets import make_shardset
from torch import nn

from shards.format.manifest import Manifest
from trainer import metrics
from trainer.data import ClipLoader, EpochOptions
from trainer.model.tsm import ModelConfig, build
from trainer.precise_bn import recompute

CONFIG = ModelConfig(num_classes=3, segments=4, depth=10, width=8)


def bn_layers(model) -> list[nn.BatchNorm2d]:
    return [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]


def stem_input_stats(model, clips: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance per channel of the first BN layer's input, computed by hand."""
    with torch.no_grad():
        x = model.backbone.conv1((clips.flatten(0, 1).float() - model.mean) / model.std).double()
    return x.mean((0, 2, 3)), x.var((0, 2, 3))


def test_running_statistics_are_the_population_statistics_of_the_batches():
    torch.manual_seed(0)
    # batches of different brightness: their means differ, so averaging per-batch variances would be wrong
    batches = [(torch.rand(2, 4, 3, 32, 32) * 255 * s).to(torch.uint8) for s in (0.3, 0.6, 1.0)]
    model = build(CONFIG)
    reference = copy.deepcopy(model)
    params = {k: v.clone() for k, v in model.named_parameters()}
    tracked = [m.num_batches_tracked.clone() for m in bn_layers(model)]
    recompute(model, batches)

    per_batch = []  # each layer's (mean, unbiased variance, count) on each batch, from BN with momentum 1
    for clips in batches:
        m = copy.deepcopy(reference).train()
        for layer in bn_layers(m):
            layer.momentum = 1.0
        counts = []
        hooks = [layer.register_forward_pre_hook(lambda mod, a: counts.append(a[0].numel() // a[0].shape[1]))
                 for layer in bn_layers(m)]
        with torch.no_grad():
            m(clips)
        for h in hooks:
            h.remove()
        per_batch.append([(layer.running_mean.double(), layer.running_var.double(), n)
                          for layer, n in zip(bn_layers(m), counts)])
    for i, layer in enumerate(bn_layers(model)):
        means = torch.stack([b[i][0] for b in per_batch])
        variances = torch.stack([b[i][1] for b in per_batch])
        n = per_batch[0][i][2]
        total = n * len(batches)
        mean = means.mean(0)
        spread = ((n - 1) * variances + n * (means - mean) ** 2).sum(0)  # sum of squared deviations
        torch.testing.assert_close(layer.running_mean.double(), mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(layer.running_var.double(), spread / (total - 1), rtol=1e-4, atol=1e-5)
    mean, var = stem_input_stats(reference, torch.cat(batches))
    first = bn_layers(model)[0]
    torch.testing.assert_close(first.running_mean.double(), mean, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(first.running_var.double(), var, rtol=1e-4, atol=1e-5)
    assert all(torch.equal(p, params[k]) for k, p in model.named_parameters())
    assert all(torch.equal(m.num_batches_tracked, n) for m, n in zip(bn_layers(model), tracked))

    partial = build(CONFIG, bn="partial")  # TSM's partial BN: only the first layer learns
    before = [layer.running_var.clone() for layer in bn_layers(partial)]
    recompute(partial, batches)
    after = [layer.running_var for layer in bn_layers(partial)]
    assert not torch.equal(after[0], before[0])
    assert all(torch.equal(a, b) for a, b in zip(after[1:], before[1:]))


def test_trainer_recomputes_at_the_full_shape_before_validation(tmp_path):
    data = tmp_path / "data"
    make_shardset(str(data), {"train": 14}, per_shard=7, frames=8, size=(48, 40))  # one multigrid period
    out = tmp_path / "run"
    flags = ["--crop-size", "32", "--scale-size", "36", "--batch-size", "2", "--workers", "0", "--seed", "3"]
    subprocess.run([sys.executable, "-m", "trainer", "train", "--data", str(data), "--output-dir", str(out),
                    "--backend", "none", "--segments", "8", "--depth", "10", "--width", "8", "--epochs", "2",
                    "--warmup-epochs", "0", "--multigrid", "short", "--precise-bn", "2", "--no-tensorboard",
                    "--val-split", "", *flags], check=True, capture_output=True, timeout=300,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    records = metrics.read(str(out / "metrics.jsonl"))
    epochs = [r for r in records if r["event"] == "epoch"]
    assert epochs and all(r["precise_bn_time"] > 0 and r["precise_bn_cpu"] > 0 for r in epochs)

    state = torch.load(out / "checkpoint.pt", weights_only=False)
    model = build(state["model_config"])
    model.load_state_dict(state["model"])
    loader = ClipLoader(Manifest.load(str(data)), "train", EpochOptions(batch_size=2, train=True, seed=3,
                                                                        epoch=len(epochs) - 1),
                        num_workers=0, crop_size=32, scale_size=36)
    clips = [b["clips"] for _, b in zip(range(2), loader)]
    assert clips[0].shape[-2:] == (32, 32)
    mean, var = stem_input_stats(model, torch.cat(clips))
    first = bn_layers(model)[0]
    torch.testing.assert_close(first.running_mean.double(), mean, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(first.running_var.double(), var, rtol=1e-4, atol=1e-5)
