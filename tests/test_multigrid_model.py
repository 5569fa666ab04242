"""The model under multigrid: the shift follows each batch's T, sub-batch BN, and torch.compile."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from trainer.model.resnet import BasicBlock, NoShift
from trainer.model.subbatch_bn import SubBatchNorm2d, SubBatchNorm3d, group_sizes, set_clips_per_group
from trainer.model.temporal_shift import TemporalShift
from trainer.model.tsm import ModelConfig, build


def shift_by_definition(x: torch.Tensor, segments: int, div: int = 8) -> torch.Tensor:
    """TSM's shift frame by frame: channels [0, C/div) from frame t+1, [C/div, 2C/div) from t-1, zeros
    where that frame does not exist, the rest unchanged."""
    fold = x.shape[1] // div
    v = x.reshape(-1, segments, *x.shape[1:])
    out = v.clone()
    for t in range(segments):
        out[:, t, :fold] = v[:, t + 1, :fold] if t + 1 < segments else 0
        out[:, t, fold:2 * fold] = v[:, t - 1, fold:2 * fold] if t > 0 else 0
    return out.reshape(x.shape)


def tiny(segments: int = 8, shift: bool = True, **kw):
    torch.manual_seed(0)
    return build(ModelConfig(num_classes=5, segments=segments, depth=10, width=8, shift=shift), **kw)


def test_the_shift_follows_the_frames_of_each_batch():
    model = tiny().train()
    seen = []
    for m in model.modules():
        if isinstance(m, TemporalShift):
            m.register_forward_hook(lambda mod, args,
                                    out: seen.append((args[0].detach(), args[1], out.detach())))
    for t in (8, 4, 2):
        seen.clear()
        clips = torch.randint(0, 256, (2, t, 3, 32, 32), dtype=torch.uint8)
        model(clips).sum().backward()
        assert len(seen) == 4  # one shift per residual block of ResNet-10
        for x, segments, out in seen:
            assert segments == t and x.shape[0] == 2 * t
            assert torch.equal(out, shift_by_definition(x, t))
    with pytest.raises(ValueError, match="8 frames"):
        model(torch.zeros(1, 16, 3, 32, 32, dtype=torch.uint8))


@pytest.mark.parametrize("t", [8, 4, 2])
def test_the_shift_gradient_is_the_adjoint_at_every_t(t):
    x = torch.randn(3 * t, 16, 2, 2, requires_grad=True)
    g = torch.randn(3 * t, 16, 2, 2)
    TemporalShift(8)(x, t).backward(g)
    expected = torch.autograd.functional.vjp(lambda a: shift_by_definition(a, t), x.detach(), g)[1]
    assert torch.equal(x.grad, expected)


def test_a_shorter_clip_is_a_different_input_not_an_error():
    model = tiny().eval()
    clips = torch.randint(0, 256, (2, 8, 3, 32, 32), dtype=torch.uint8)
    with torch.no_grad():
        full, half = model(clips), model(clips[:, ::2])
    assert full.shape == half.shape == (2, 5)
    assert not torch.allclose(full, half, atol=1e-4)


@pytest.mark.parametrize("clips,per_group,expected", [(8, 8, [8]), (16, 8, [8, 8]), (15, 8, [15]),
                                                      (17, 8, [9, 8]),
                                                      (7, 2, [3, 2, 2]), (64, 8, [8] * 8), (5, 16, [5])])
def test_groups_are_as_equal_as_possible(clips, per_group, expected):
    assert group_sizes(clips, per_group) == expected


@pytest.mark.parametrize("clips,per_group,segments,channels_last,i3d", [
    (6, 2, 3, False, False), (7, 2, 2, True, False), (8, 4, 1, False, False), (4, 8, 2, False, False),
    (6, 2, 3, False, True), (7, 2, 2, True, True), (4, 8, 2, False, True)])
def test_sub_batch_bn_equals_separate_bns_on_the_groups(clips, per_group, segments, channels_last, i3d):
    """Frames (N*T, C, H, W) of a 2D network, or (``i3d``) an I3D's clips (N, C, T, H, W) against
    ``nn.BatchNorm3d``."""
    torch.manual_seed(1)
    plain = nn.BatchNorm3d(6) if i3d else nn.BatchNorm2d(6)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 2)
        plain.bias.uniform_(-1, 1)
    sub = (SubBatchNorm3d if i3d else SubBatchNorm2d)(6)
    sub.load_state_dict(plain.state_dict())
    sub.clips_per_group = per_group
    rows = 1 if i3d else segments  # of the first dimension per clip
    shape = (clips, 6, segments, 5, 4) if i3d else (clips * segments, 6, 5, 4)
    x = torch.randn(shape) * 3 + torch.arange(shape[0]).view(-1, *[1] * (len(shape) - 1)) * 0.2
    memory_format = torch.channels_last_3d if i3d else torch.channels_last
    if channels_last:
        x = x.contiguous(memory_format=memory_format)
    sizes = group_sizes(clips, per_group)
    # reference: one BN layer per group of whole clips, each a copy of the same layer
    x_ref, x_sub = x.clone().requires_grad_(), x.clone().requires_grad_()
    layers = [copy.deepcopy(plain).train() for _ in sizes]
    out_ref = torch.cat([bn(part) for bn, part in zip(layers, x_ref.split([n * rows for n in sizes]))])
    out = sub.train()(x_sub, segments)
    assert torch.allclose(out, out_ref, atol=1e-5)
    if len(sizes) > 1:  # the groups really are normalised apart: not what one BN over the batch gives
        assert not torch.allclose(out, copy.deepcopy(plain).train()(x), atol=1e-3)
    g = torch.randn_like(x)
    out_ref.backward(g)
    out.backward(g)
    assert torch.allclose(x_sub.grad, x_ref.grad, atol=1e-5)
    assert torch.allclose(sub.weight.grad, sum(bn.weight.grad for bn in layers), atol=1e-4)
    assert torch.allclose(sub.bias.grad, sum(bn.bias.grad for bn in layers), atol=1e-4)
    # running statistics: one update per batch with the whole batch's mean and unbiased variance
    whole = copy.deepcopy(plain).train()
    whole(x)
    assert torch.allclose(sub.running_mean, whole.running_mean, atol=1e-6)
    assert torch.allclose(sub.running_var, whole.running_var, rtol=1e-5)
    assert sub.num_batches_tracked.item() == 1
    if channels_last:
        assert out.is_contiguous(memory_format=memory_format)


def test_sub_batch_bn_changes_no_parameter_buffer_or_checkpoint_key():
    plain, grouped = tiny(), tiny(bn_group=2)
    assert plain.state_dict().keys() == grouped.state_dict().keys()
    assert [(n, p.shape) for n, p in plain.named_parameters()] == [(n, p.shape) for n,
                                                                   p in grouped.named_parameters()]
    grouped.load_state_dict(plain.state_dict())
    clips = torch.randint(0, 256, (8, 4, 3, 32, 32), dtype=torch.uint8)
    with torch.no_grad():
        # evaluation uses the running statistics: identical networks
        assert torch.equal(plain.eval()(clips), grouped.eval()(clips))
        # training normalises groups of 2 clips: a different function of the same parameters
        assert not torch.allclose(plain.train()(clips), grouped.train()(clips), atol=1e-4)
        set_clips_per_group(grouped, 0)
        assert torch.allclose(plain.train()(clips), grouped.train()(clips), atol=1e-5)


def test_frozen_layers_ignore_the_groups():
    model = tiny(bn="frozen", bn_group=1).train()
    clips = torch.randint(0, 256, (4, 2, 3, 32, 32), dtype=torch.uint8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model(clips)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_shift_and_sub_batch_bn_compile_without_graph_breaks():
    """``fullgraph=True`` fails on any graph break; the compiled block matches eager at each T."""
    torch.manual_seed(2)
    block = BasicBlock(16, 16, 1, None, lambda: TemporalShift(8))
    set_clips_per_group(block, 2)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True, dynamic=False)
    for t in (4, 2):
        x = torch.randn(4 * t, 16, 6, 6)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        eager_out = block(xa, t)
        compiled_out = compiled(xb, t)
        assert torch.allclose(eager_out, compiled_out, atol=1e-5)
        eager_out.sum().backward()
        compiled_out.sum().backward()
        assert torch.allclose(xa.grad, xb.grad, atol=1e-5)
    assert isinstance(BasicBlock(4, 4, 1, None, NoShift).shift, NoShift)
