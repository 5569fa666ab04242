"""TSM model: the temporal shift, the ResNet backbone, pretrained loading and BN modes."""
from __future__ import annotations

import math

import pytest
import torch

from trainer.model.resnet import NoShift, ResNet
from trainer.model.temporal_shift import TemporalShift, temporal_shift
from trainer.model.tsm import ModelConfig, VideoNet, build, load_pretrained


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


def tiny(shift: bool, **kw) -> VideoNet:
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


# torchvision's resnet.py: block type, blocks per stage, and the ImageNet checkpoints' sizes
TORCHVISION = {18: ("basic", (2, 2, 2, 2), 122, 11_689_512), 50: ("bottleneck", (3, 4, 6, 3), 320,
                                                                  25_557_032)}


def torchvision_shapes(depth: int) -> dict[str, tuple[int, ...]]:
    """The names and shapes of ``torchvision.models.resnet<depth>().state_dict()``, written out
    from torchvision's model definition (not from this project's ResNet)."""
    kind, counts, _, _ = TORCHVISION[depth]

    def bn(name, c):
        return {f"{name}.weight": (c,), f"{name}.bias": (c,), f"{name}.running_mean": (c,),
                f"{name}.running_var": (c,), f"{name}.num_batches_tracked": ()}
    shapes, cin = {"conv1.weight": (64, 3, 7, 7), **bn("bn1", 64)}, 64
    for stage, (planes, blocks) in enumerate(zip((64, 128, 256, 512), counts), 1):
        cout = planes * (4 if kind == "bottleneck" else 1)
        for b in range(blocks):
            at = f"layer{stage}.{b}"
            if kind == "basic":
                shapes |= {f"{at}.conv1.weight": (planes, cin, 3, 3), **bn(f"{at}.bn1", planes),
                           f"{at}.conv2.weight": (planes, planes, 3, 3), **bn(f"{at}.bn2", planes)}
            else:
                shapes |= {f"{at}.conv1.weight": (planes, cin, 1, 1), **bn(f"{at}.bn1", planes),
                           f"{at}.conv2.weight": (planes, planes, 3, 3), **bn(f"{at}.bn2", planes),
                           f"{at}.conv3.weight": (cout, planes, 1, 1), **bn(f"{at}.bn3", cout)}
            if b == 0 and (stage > 1 or cin != cout):
                shapes |= {f"{at}.downsample.0.weight": (cout, cin, 1, 1), **bn(f"{at}.downsample.1", cout)}
            cin = cout
    return shapes | {"fc.weight": (1000, cin), "fc.bias": (1000,)}


def handmade_state(depth: int) -> dict[str, torch.Tensor]:
    """Every tensor distinct: He-scaled random convolutions, BN statistics and affine parameters
    drawn per layer, ``num_batches_tracked`` numbered."""
    g = torch.Generator().manual_seed(depth)
    state = {}
    for i, (name, shape) in enumerate(torchvision_shapes(depth).items()):
        if name.endswith("num_batches_tracked"):
            state[name] = torch.tensor(i)
        elif len(shape) == 4:
            state[name] = torch.randn(shape, generator=g) * (2 / (shape[1] * shape[2] * shape[3])) ** 0.5
        elif name.endswith(("running_var", "weight")) and not name.startswith("fc"):
            state[name] = 0.5 + torch.rand(shape, generator=g)
        else:
            state[name] = 0.1 * torch.randn(shape, generator=g)
    return state


def reference_features(state: dict[str, torch.Tensor], depth: int, x: torch.Tensor) -> torch.Tensor:
    """torchvision's ResNet forward in eval mode, in plain functional calls on ``state``."""
    import torch.nn.functional as F

    def bn(name, y):
        return F.batch_norm(y, state[f"{name}.running_mean"], state[f"{name}.running_var"],
                            state[f"{name}.weight"], state[f"{name}.bias"], False, 0.0, 1e-5)
    kind, counts, _, _ = TORCHVISION[depth]
    y = F.max_pool2d(F.relu(bn("bn1", F.conv2d(x, state["conv1.weight"], stride=2, padding=3))), 3, 2, 1)
    for stage, blocks in enumerate(counts, 1):
        for b in range(blocks):
            at, stride = f"layer{stage}.{b}", 2 if stage > 1 and b == 0 else 1
            if kind == "basic":
                out = F.relu(bn(f"{at}.bn1", F.conv2d(y, state[f"{at}.conv1.weight"], stride=stride,
                                                      padding=1)))
                out = bn(f"{at}.bn2", F.conv2d(out, state[f"{at}.conv2.weight"], padding=1))
            else:  # v1.5: the stride is in the 3x3 convolution
                out = F.relu(bn(f"{at}.bn1", F.conv2d(y, state[f"{at}.conv1.weight"])))
                out = F.relu(bn(f"{at}.bn2", F.conv2d(out, state[f"{at}.conv2.weight"], stride=stride,
                                                      padding=1)))
                out = bn(f"{at}.bn3", F.conv2d(out, state[f"{at}.conv3.weight"]))
            if f"{at}.downsample.0.weight" in state:
                y = bn(f"{at}.downsample.1", F.conv2d(y, state[f"{at}.downsample.0.weight"], stride=stride))
            y = F.relu(out + y)
    return y.mean((2, 3))


@pytest.mark.parametrize("depth,wrap", [(18, False), (50, True)])
def test_torchvision_weights_land_in_the_right_layers(tmp_path, depth, wrap):
    """A state dict with torchvision's exact names and shapes, written by hand with a distinct
    value in every tensor: each lands where torchvision uses it (a functional torchvision forward
    on the dict gives the backbone's features), the classifier stays new. ``wrap``: saved the way
    a DataParallel training script does (``module.`` prefixes under ``state_dict``)."""
    shapes = torchvision_shapes(depth)
    params = sum(math.prod(s) for k, s in shapes.items()
                 if not k.endswith(("running_mean", "running_var", "tracked")))
    assert (len(shapes), params) == TORCHVISION[depth][2:]  # the published checkpoints' sizes
    state = handmade_state(depth)
    saved = {"state_dict": {f"module.{k}": v for k, v in state.items()}} if wrap else state
    torch.save(saved, tmp_path / "weights.pth")
    torch.manual_seed(0)
    model = build(ModelConfig(num_classes=7, segments=2, depth=depth)).eval()
    head = model.fc.weight.clone(), model.fc.bias.clone()
    report = load_pretrained(model, str(tmp_path / "weights.pth"))
    backbone = sorted(k for k in shapes if not k.startswith("fc."))
    assert report == {"loaded": backbone, "new": ["fc.weight", "fc.bias"],
                      "ignored": ["fc.bias", "fc.weight"],
                      "adapted": [], "inflated": []}
    assert torch.equal(model.fc.weight, head[0]) and torch.equal(model.fc.bias, head[1])
    last, conv = len(model.backbone.layer4) - 1, "conv3" if depth == 50 else "conv2"
    assert torch.equal(getattr(model.backbone.layer4[last], conv).weight,
                       state[f"layer4.{last}.{conv}.weight"])
    assert torch.equal(model.backbone.layer2[0].downsample[1].running_var,
                       state["layer2.0.downsample.1.running_var"])
    for block in (b for stage in (1, 2, 3, 4) for b in getattr(model.backbone, f"layer{stage}")):
        block.shift = NoShift()  # the frames' own features: torchvision's network
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, reference = model.backbone(x, 1), reference_features(state, depth, x)
    assert reference.abs().mean() > 0.1  # the activations did not die out
    assert torch.allclose(ours, reference, rtol=1e-4, atol=1e-4)


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


def test_the_network_has_no_default_for_the_frames_per_clip():
    """T decides the temporal shift: a caller that forgets it gets an error, not a TSN in disguise."""
    model = tiny(shift=True)
    frames = torch.zeros(4 * 2, 3, 16, 16)
    with pytest.raises(TypeError):
        model.backbone(frames)
    with pytest.raises(TypeError):
        ModelConfig(num_classes=5)
