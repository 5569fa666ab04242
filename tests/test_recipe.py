"""The 15-minute recipe: linear lr scaling, warm-up plus cosine, and weight decay on weights only."""
from __future__ import annotations

import math

import pytest
import torch

from trainer.model.tsm import ModelConfig, build
from trainer.schedules import recipe


def test_linear_scaling_rule():
    assert recipe.scaled_lr(0.00125, 8) == pytest.approx(0.00125)
    assert recipe.scaled_lr(0.00125, 64) == pytest.approx(0.01)
    assert recipe.scaled_lr(0.00125, 12288) == pytest.approx(1.92)


@pytest.mark.parametrize("seen,factor", [
    (0, 0.0), (4, 0.4), (9, 0.9),  # warm-up: seen / 10
    (10, 1.0), (35, 0.5 * (1 + math.cos(math.pi / 4))), (60, 0.5), (85, 0.5
                                                                    * (1 + math.cos(3 * math.pi / 4))),
    (110, 0.0),
])
def test_warmup_cosine_multiplier(seen, factor):
    assert recipe.warmup_cosine(seen, 10, 110) == pytest.approx(factor)


def test_schedule_rejects_warmup_longer_than_training():
    with pytest.raises(ValueError):
        recipe.Schedule(0.1, warmup_clips=20, total_clips=10)


def model():
    torch.manual_seed(0)
    return build(ModelConfig(num_classes=3, segments=2, depth=10, width=4))


def test_optimizer_follows_the_recipe_at_chosen_steps():
    """Epochs of 128 clips, 5 of warm-up, 20 in all, global batch 32: lr peaks at 0.005."""
    net = model()
    peak = recipe.scaled_lr(0.00125, 32)
    opt = recipe.build_optimizer(net, peak)
    schedule = recipe.Schedule(peak, warmup_clips=5 * 128, total_clips=20 * 128)
    seen = {}
    for step in range(80):
        seen[step] = schedule.apply(opt, step * 32)
        assert all(g["lr"] == seen[step] for g in opt.param_groups)
        opt.step()
    assert seen[0] == 0 and seen[1] == pytest.approx(peak / 20)
    assert seen[19] == pytest.approx(peak * 19 / 20)
    assert seen[20] == pytest.approx(peak)
    assert seen[50] == pytest.approx(peak / 2)
    assert seen[79] == pytest.approx(peak * 0.5 * (1 + math.cos(math.pi * 59 / 60)))
    assert all(seen[s] >= seen[s + 1] for s in range(20, 79))
    assert opt.defaults["momentum"] == 0.9


def test_bn_and_bias_parameters_get_no_weight_decay():
    net = model()
    decay, no_decay = recipe.param_groups(net, 1e-4)
    assert decay["weight_decay"] == 1e-4 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in net.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    exempt = {names[id(p)] for p in no_decay["params"]}
    assert decayed | exempt == set(names.values()) and not decayed & exempt
    assert "fc.bias" in exempt and "backbone.bn1.weight" in exempt and "backbone.layer1.0.bn2.bias" in exempt
    assert "fc.weight" in decayed and "backbone.layer2.0.downsample.0.weight" in decayed
    assert all(n.endswith("conv1.weight") or n.endswith("conv2.weight") or "downsample.0" in n
               or n == "fc.weight"
               for n in decayed)

    # through the real optimizer: with zero gradients only weight decay moves anything
    opt = recipe.build_optimizer(net, lr=0.1, weight_decay=0.01)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in net.named_parameters():
        if n in exempt:
            assert torch.equal(p, before[n]), n
        else:
            assert torch.allclose(p, before[n] * (1 - 0.1 * 0.01)), n


def test_frozen_parameters_are_left_out():
    net = build(ModelConfig(num_classes=3, segments=2, depth=10, width=4), bn="partial")
    params = [p for g in recipe.param_groups(net, 1e-4) for p in g["params"]]
    assert len(params) == sum(p.requires_grad for p in net.parameters())
    assert any(p is net.backbone.bn1.weight for p in params)
    assert not any(p is net.backbone.layer1[0].bn1.weight for p in params)
