"""TSM model: the temporal shift, the ResNet backbone, pretrained loading and BN modes."""
from __future__ import annotations

import pytest
import torch

from trainer.model import ModelConfig, TSM, build, load_pretrained
from trainer.resnet import ResNet
from trainer.temporal_shift import TemporalShift, temporal_shift


def reference_shift(x: torch.Tensor, segments: int, div: int) -> torch.Tensor:
    """The shift written as the paper states it, one (clip, frame, channel) at a time."""
    nt, c = x.shape[:2]
    fold = c // div
    v = x.view(nt // segments, segments, c, *x.shape[2:])
    out = torch.zeros_like(v)
    for n in range(v.shape[0]):
        for t in range(segments):
            for ch in range(c):
                if ch < fold:
                    src = t + 1  # from the next frame
                elif ch < 2 * fold:
                    src = t - 1  # from the previous frame
                else:
                    src = t
                if 0 <= src < segments:
                    out[n, t, ch] = v[n, src, ch]
    return out.view_as(x)


def unique_activations(n: int, t: int, c: int, h: int = 3, w: int = 2) -> torch.Tensor:
    return torch.arange(1, n * t * c * h * w + 1, dtype=torch.float32).view(n * t, c, h, w)


@pytest.mark.parametrize("n,t,c,div", [(2, 8, 16, 8), (1, 4, 20, 8), (3, 3, 12, 4), (1, 2, 7, 8)])
def test_shift_moves_exactly_the_described_channels(n, t, c, div):
    x = unique_activations(n, t, c)
    out = temporal_shift(x, t, div)
    assert torch.equal(out, reference_shift(x, t, div))
    fold = c // div
    v, o = x.view(n, t, c, 3, 2), out.view(n, t, c, 3, 2)
    assert torch.all(o[:, -1, :fold] == 0) and torch.all(o[:, 0, fold:2 * fold] == 0)  # zero-padded ends
    assert torch.equal(o[:, :, 2 * fold:], v[:, :, 2 * fold:])  # the rest stays
    assert torch.equal(x, unique_activations(n, t, c))  # the input is untouched


def test_shift_keeps_channels_last_and_passes_gradients_back_shifted():
    x = unique_activations(2, 4, 16).contiguous(memory_format=torch.channels_last).requires_grad_()
    out = temporal_shift(x, 4, 8)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out.detach(), reference_shift(x.detach(), 4, 8))
    g = torch.randn_like(out)
    out.backward(g)
    # the shift is linear: its gradient is the adjoint, the opposite shift
    expected = torch.autograd.functional.vjp(lambda a: reference_shift(a, 4, 8), x.detach(), g)[1]
    assert torch.equal(x.grad, expected)


def test_shift_rejects_a_batch_that_is_not_whole_clips():
    with pytest.raises(ValueError, match="whole number"):
        temporal_shift(torch.zeros(6, 8, 2, 2), 4)


def tiny(shift: bool, **kw) -> TSM:
    torch.manual_seed(0)
    return build(ModelConfig(num_classes=5, segments=4, depth=18, width=8, shift=shift), **kw).eval()


def test_shift_costs_no_parameters():
    assert list(TemporalShift(8).parameters()) == []
    tsm, tsn = tiny(True), tiny(False)
    assert tsm.state_dict().keys() == tsn.state_dict().keys()
    assert sum(p.numel() for p in tsm.parameters()) == sum(p.numel() for p in tsn.parameters())
    assert sum(isinstance(m, TemporalShift) for m in tsm.modules()) == 8  # one per residual block
    assert not any(isinstance(m, TemporalShift) for m in tsn.modules())


def test_only_tsm_sees_frame_order():
    clips = torch.randint(0, 256, (2, 4, 3, 32, 32), dtype=torch.uint8)
    reversed_clips = clips.flip(1)
    with torch.no_grad():
        tsn = tiny(False)
        assert torch.allclose(tsn(clips), tsn(reversed_clips), atol=1e-5)  # average of independent frames
        tsm = tiny(True)
        assert not torch.allclose(tsm(clips), tsm(reversed_clips), atol=1e-3)


def test_forward_shape_and_frame_count_check():
    model = tiny(True)
    assert model(torch.zeros(3, 4, 3, 32, 32, dtype=torch.uint8)).shape == (3, 5)
    with pytest.raises(ValueError, match="4 frames"):
        model(torch.zeros(1, 8, 3, 32, 32, dtype=torch.uint8))


def test_channels_last_gives_the_same_scores():
    clips = torch.randint(0, 256, (2, 4, 3, 32, 32), dtype=torch.uint8)
    with torch.no_grad():
        plain = tiny(True)(clips)
        nhwc = tiny(True, channels_last=True).to(memory_format=torch.channels_last)(clips)
    assert torch.allclose(plain, nhwc, atol=1e-5)


@pytest.mark.parametrize("depth,params", [(18, 11_689_512), (50, 25_557_032)])
def test_resnet_matches_torchvision_sizes_and_names(depth, params):
    backbone = ResNet(depth)
    head = backbone.feature_dim * 1000 + 1000  # torchvision's ImageNet classifier
    assert sum(p.numel() for p in backbone.parameters()) + head == params
    keys = backbone.state_dict().keys()
    for key in ("conv1.weight", "bn1.running_var", "layer1.0.conv1.weight", "layer2.0.downsample.0.weight",
                "layer2.0.downsample.1.num_batches_tracked", "layer4.1.bn2.bias"):
        assert key in keys


def test_load_pretrained_reports_loaded_new_and_ignored(tmp_path):
    torch.manual_seed(1)
    source = ResNet(18, width=8)
    state = {f"module.{k}": v for k, v in source.state_dict().items()}
    state["module.fc.weight"], state["module.fc.bias"] = torch.randn(1000, 64), torch.randn(1000)
    path = tmp_path / "resnet18.pth"
    torch.save({"state_dict": state}, path)
    model = tiny(True)
    head_before = model.fc.weight.clone()
    report = load_pretrained(model, str(path))
    assert set(report["loaded"]) == set(source.state_dict())
    assert report["new"] == ["fc.weight", "fc.bias"]
    assert report["ignored"] == ["fc.bias", "fc.weight"]
    for key, value in source.state_dict().items():
        assert torch.equal(model.backbone.state_dict()[key], value)
    assert torch.equal(model.fc.weight, head_before)


def test_partial_bn_freezes_all_but_the_first():
    model = tiny(True, bn="partial").train()
    bns = [m for m in model.backbone.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns[0].training and bns[0].weight.requires_grad
    assert all(not b.training and not b.weight.requires_grad and not b.bias.requires_grad for b in bns[1:])
    before = [b.running_mean.clone() for b in bns]
    model(torch.randint(0, 256, (2, 4, 3, 32, 32), dtype=torch.uint8))
    assert not torch.equal(bns[0].running_mean, before[0])
    assert all(torch.equal(b.running_mean, m) for b, m in zip(bns[1:], before[1:]))


def test_frozen_bn_freezes_every_bn_layer():
    model = tiny(True, bn="frozen").train()
    bns = [m for m in model.backbone.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert all(not b.training and not b.weight.requires_grad for b in bns)
    assert model.fc.weight.requires_grad and model.backbone.conv1.weight.requires_grad
