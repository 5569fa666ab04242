"""The I3D baselines (``--arch i3d-3x3x3|i3d-3x1x1``): their blocks and temporal resolution, the
inflation of 2D weights, their learning the direction of motion, and the trainer's handling of the
architecture (checkpoint, resume, test, the schedules and the motion stream).

The block table below is written from the references (trainer/model/i3d.py: Wang et al. 2018 and
SlowFast's I3D configuration), not read from the code under test.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers.shardsets import make_shardset

from trainer import cli
from trainer.model.i3d import INFLATIONS
from trainer.model.tsm import ModelConfig, build, load_pretrained

# the blocks whose kernel has 3 time steps, per stage (res2..res5 of ResNet-50: 3, 4, 6, 3 blocks);
# every other block is 2D in time (1xkxk), and conv1 is 5x7x7
TEMPORAL_BLOCKS = {1: (0, 1, 2), 2: (0, 2), 3: (0, 2, 4), 4: (1,)}
INFLATED_CONV = {"i3d-3x3x3": "conv2", "i3d-3x1x1": "conv1"}  # the 3x3 one, or the first 1x1 one
WIDTH, SIZE = 4, 32


def network(arch: str, segments: int = 8, **kw):
    torch.manual_seed(0)
    return build(ModelConfig(num_classes=5, segments=segments, depth=50, width=WIDTH, arch=arch), **kw)


@pytest.mark.parametrize("arch", sorted(INFLATIONS))
def test_every_kernel_has_the_temporal_size_of_the_references(arch):
    backbone = network(arch).backbone
    assert tuple(backbone.conv1.weight.shape) == (WIDTH, 3, 5, 7, 7)
    for stage in (1, 2, 3, 4):
        for index, block in enumerate(getattr(backbone, f"layer{stage}")):
            for name in ("conv1", "conv2", "conv3"):
                kernel = tuple(getattr(block, name).weight.shape[2:])
                time = 3 if name == INFLATED_CONV[arch] and index in TEMPORAL_BLOCKS[stage] else 1
                assert kernel == (time, *((3, 3) if name == "conv2" else (1, 1))), (stage, index, name)
            if block.downsample is not None:
                assert tuple(block.downsample[0].weight.shape[2:]) == (1, 1, 1)


@pytest.mark.parametrize("arch", sorted(INFLATIONS))
@pytest.mark.parametrize("frames", [1, 2, 5, 8])
def test_every_block_keeps_time_until_res3_which_halves_it(arch, frames):
    """Every block's output (N, C, T, H, W) for clips of 1, 2, 5 and 8 frames: conv1 and res2 at T,
    res3-res5 at ceil(T / 2) (the one temporal max-pool, after res2); channels and space as ResNet-50's."""
    model = network(arch, segments=8).eval()
    shapes = {}
    hooks = [m.register_forward_hook(lambda m, i, o, name=name: shapes.__setitem__(name, tuple(o.shape)))
             for name, m in model.backbone.named_modules() if name == "maxpool" or name.count(".") == 1]
    with torch.no_grad():
        scores = model(torch.randint(0, 256, (2, frames, 3, SIZE, SIZE), dtype=torch.uint8))
    for h in hooks:
        h.remove()
    assert scores.shape == (2, 5)
    half = math.ceil(frames / 2)
    expected = {"maxpool": (2, WIDTH, frames, SIZE // 4, SIZE // 4)}
    for stage, blocks in zip((1, 2, 3, 4), (3, 4, 6, 3)):
        time = frames if stage == 1 else half
        for index in range(blocks):
            expected[f"layer{stage}.{index}"] = (2, WIDTH * 2 ** (stage + 1), time, SIZE // 2 ** (stage + 1),
                                                 SIZE // 2 ** (stage + 1))
    assert shapes == expected


def test_channels_last_gives_the_same_scores():
    clips = torch.randint(0, 256, (2, 4, 3, SIZE, SIZE), dtype=torch.uint8)
    plain = network("i3d-3x3x3").eval()
    nhwc = network("i3d-3x3x3", channels_last=True).eval()
    nhwc.to(memory_format=nhwc.memory_format)
    assert nhwc.backbone.layer2[0].conv2.weight.is_contiguous(memory_format=torch.channels_last_3d)
    with torch.no_grad():
        assert torch.allclose(plain(clips), nhwc(clips), atol=1e-5)


def randomised_bn(model) -> None:
    """Running statistics and affine parameters drawn per layer: evaluation then depends on each."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            for t, lo in ((m.running_mean, -0.2), (m.running_var, 0.5), (m.weight, 0.5), (m.bias, -0.2)):
                t.data = lo + torch.rand(t.shape, generator=g) * abs(2 * lo)


# an output time step t (after the pool, 2 frames each) sees frames 2t - 17 .. 2t + 1 + 17: conv1 (5)
# reaches 2 frames each way and res2's three temporal kernels 3 more, 5 in all before the pool; after
# it, res3's two, res4's three and res5's one kernel of 3 reach 6 steps, 12 frames, each way
REACH = 17


@pytest.mark.parametrize("arch", sorted(INFLATIONS))
def test_inflation_gives_the_2d_networks_features_on_a_constant_clip_where_no_zero_padding_reaches(
        arch, tmp_path):
    """ImageNet inflation: a 2D network's weights (a TSN's backbone in torchvision's format, its BN
    statistics drawn at random) loaded into an I3D, every kernel repeated over its t time steps and
    divided by t. On a clip whose 48 frames are all one frame, each time step whose receptive field lies
    inside the clip has exactly the 2D network's features of that frame; the steps within reach of the
    clip's ends differ, because time is zero-padded there (an end frame's missing neighbours are zeros,
    not copies of it), so the network's average over time is not the 2D network's output."""
    torch.manual_seed(0)
    image = build(ModelConfig(num_classes=5, segments=1, depth=50, width=WIDTH, arch="tsn")).eval()
    randomised_bn(image)
    torch.save(image.backbone.state_dict(), tmp_path / "resnet50.pth")
    model = network(arch, segments=48).eval()
    report = load_pretrained(model, str(tmp_path / "resnet50.pth"))
    convs = sorted(k for k, v in image.backbone.state_dict().items() if v.dim() == 4)
    assert (report["inflated"] == convs and report["ignored"] == []
            and report["new"] == ["fc.weight", "fc.bias"])
    own = model.backbone.state_dict()
    for key in convs:  # each time slice is the 2D kernel over t
        time = own[key].shape[2]
        assert all(torch.equal(own[key][:, :, k], image.backbone.state_dict()[key] / time)
                   for k in range(time)), key
    assert own["conv1.weight"].shape[2] == 5

    frame = torch.randint(0, 256, (1, 1, 3, SIZE, SIZE), dtype=torch.uint8)
    with torch.no_grad():
        x = (frame.flatten(0, 1).float() - image.mean) / image.std
        reference = image.backbone(x, 1)[0]  # the 2D network's features of the frame
        steps = model.backbone(x.repeat(48, 1, 1, 1), 48)  # (24 time steps, features)
    assert reference.abs().mean() > 0.01  # the activations did not die out
    same = [torch.allclose(s, reference, rtol=1e-4, atol=1e-5) for s in steps]
    inside = [2 * t - REACH >= 0 and 2 * t + 1 + REACH <= 47 for t in range(24)]
    assert inside.count(True) == 6 and all(same[t] for t in range(24) if inside[t]), same
    # (a step whose field reaches past an end may still agree where a ReLU cut the difference off; the
    # first and last cannot: their conv1 sees two zero frames of five)
    assert not same[0] and not same[-1], same


def moving_squares(n: int, g: torch.Generator, size: int = 16, frames: int = 4, step: int = 2, side: int = 4):
    """``n`` uint8 clips (n, T, 3, size, size) of a white square moving ``step`` px a frame right (label
    0), left (1), down (2) or up (3) over static noise, from a random start: any single frame, and the
    set of a clip's frames, fits a class and its opposite alike (a left clip is a right one reversed)."""
    labels = torch.randint(0, 4, (n,), generator=g)
    x = torch.randint(0, 96, (n, 1, 3, size, size), generator=g, dtype=torch.uint8).repeat(1, frames, 1, 1, 1)
    travel = step * (frames - 1)
    for i, label in enumerate(labels.tolist()):
        start = int(torch.randint(0, size - side - travel + 1, (1,), generator=g))
        across = int(torch.randint(0, size - side + 1, (1,), generator=g))
        for t in range(frames):
            along = start + step * t if label in (0, 2) else start + travel - step * t
            row, col = (across, along) if label < 2 else (along, across)
            x[i, t, :, row:row + side, col:col + side] = 255
    return x, labels


@pytest.mark.parametrize("arch", sorted(INFLATIONS))
def test_a_tiny_i3d_learns_the_direction_of_motion(arch):
    """A ResNet-50 I3D of width 4 trained on moving squares (150 steps of 16 clips, about 3 CPU seconds)
    tells the four directions apart on new clips. Whatever sees a clip's frames as a set (TSN, or an
    I3D without its temporal kernels: seen red at 51%, its time pool and average being symmetric)
    confuses each direction with its opposite and stays at or below 50%."""
    model = network(arch, segments=4).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: one thread is the fastest on a shared machine
    try:
        for _ in range(150):
            x, y = moving_squares(16, g)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        x, y = moving_squares(256, torch.Generator().manual_seed(1))
        with torch.no_grad():
            accuracy = (model.eval()(x).argmax(1) == y).float().mean().item()
    finally:
        torch.set_num_threads(threads)
    assert accuracy >= 0.9, f"{arch} told {accuracy:.1%} of the directions apart (sets of frames: 50%)"


# --- the trainer: the architecture in flags, checkpoints, resume and test ------------------------------
FLAGS = ["--backend", "none", "--segments", "4", "--depth", "50", "--width", "4", "--crop-size", "24",
         "--scale-size", "28", "--batch-size", "4", "--epochs", "1", "--warmup-epochs", "0", "--workers", "0",
         "--print-freq", "1", "--no-tensorboard"]


def trainer(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer", *argv], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_an_i3d_run_records_its_architecture_is_tested_as_one_and_resumes_as_no_other(tmp_path, capsys):
    data, out = tmp_path / "data", tmp_path / "run"
    make_shardset(str(data), {"train": 8, "val": 4}, per_shard=4, num_classes=3, frames=4, size=(32, 28))
    run = trainer("train", "--data", str(data), "--output-dir", str(out), "--arch", "i3d-3x1x1", *FLAGS)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "model: I3D 3x1x1 (rgb) ResNet-50 width 4, 4 frames, dropout" in run.stderr
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["model_config"]["arch"] == "i3d-3x1x1" and state["config"]["model"]["arch"] == "i3d-3x1x1"
    assert state["model"]["backbone.layer1.0.conv1.weight"].shape[2:] == (3, 1, 1)

    assert cli.main(["test", "--checkpoint", str(out), "--data", str(data), "--backend", "none", "--workers",
                     "0"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["arch"] == "i3d-3x1x1"

    before = (out / "checkpoint.pt").read_bytes()
    for flags, says in (([], "model arch i3d-3x1x1 in the checkpoint, tsm now"),
                        (["--arch", "i3d-3x3x3"], "model arch i3d-3x1x1 in the checkpoint, i3d-3x3x3 now"),
                        (["--no-shift"], "model arch i3d-3x1x1 in the checkpoint, tsn now")):
        capsys.readouterr()  # the one line the console script prints, exit status 1
        assert cli.main(["train", "--data", str(data), "--output-dir", str(out), "--resume", *FLAGS,
                         *flags]) == 1
        assert capsys.readouterr().err == (f"trainer train: error: --resume refused: {out / 'checkpoint.pt'} "
                                           f"is another run's: {says}\n")
    assert (out / "checkpoint.pt").read_bytes() == before
    resumed = trainer("train", "--data", str(data), "--output-dir", str(out), "--resume",
                      "--arch", "i3d-3x1x1", *FLAGS, "--epochs", "2")
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]
    assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] == 2


def test_an_i3d_traces_into_one_graph_for_compile():
    """``--compile``: Dynamo captures the whole I3D, the view of frames as clips and the temporal pool
    included, in one graph."""
    import torch._dynamo
    model = network("i3d-3x3x3").train()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(torch.randint(0, 256, (2, 4, 3, SIZE, SIZE), dtype=torch.uint8))
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")


@pytest.mark.long
def test_an_i3d_trains_under_every_schedule_kstep_averaging_and_the_motion_stream(tmp_path):
    """The I3Ds take the trainer's paths TSM takes: on 2 Horovod ranks, multigrid's long and short
    cycles (clips of 2, 4 and 8 frames, crops of 3 sizes, sub-batch BN) with K-step averaging and
    precise BN; in one process, the motion stream (--modality motion, 2 channels into conv1 5x7x7) with
    the batch growing at epoch 1."""
    data, motion = tmp_path / "data", tmp_path / "motion"
    make_shardset(str(data), {"train": 40, "val": 4}, per_shard=7, frames=8, size=(48, 40))
    make_shardset(str(motion), {"train": 16, "val": 4}, per_shard=4, frames=4, size=(48, 40), motion="mv")
    small = ["--depth", "50", "--width", "4", "--crop-size", "32", "--scale-size", "36",
             "--warmup-epochs", "1", "--lr-per-8", "0.05", "--workers", "1", "--print-freq", "1",
             "--no-tensorboard", "--trace-steps"]
    ranks = subprocess.run([HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m",
                            "trainer", "train", "--data", str(data), "--output-dir", str(tmp_path / "mg"),
                            "--arch", "i3d-3x3x3", "--batch-size", "2", "--epochs", "4",
                            "--multigrid", "both", "--multigrid-stages", "2", "3", "--average-every", "2",
                            "--precise-bn", "1", *small],
                           capture_output=True, text=True, timeout=900,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert ranks.returncode == 0, (ranks.stdout + ranks.stderr)[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "mg" / "steps-rank1.jsonl").read_text().splitlines()]
    assert {s["frames"] for s in steps} == {2, 4, 8} and len({s["crop"] for s in steps}) == 3
    assert torch.load(tmp_path / "mg" / "checkpoint.pt",
                      weights_only=True)["model_config"]["arch"] == "i3d-3x3x3"

    one = trainer("train", "--data", str(motion), "--output-dir", str(tmp_path / "mv"), "--backend", "none",
                  "--arch", "i3d-3x1x1", "--modality", "motion", "--batch-size", "2", "--epochs", "2",
                  "--batch-growth", "points", "--growth-points", "1", *small)
    assert one.returncode == 0, one.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "mv" / "steps-rank0.jsonl").read_text().splitlines()]
    assert [s["batch"] for s in steps] == [2] * 8 + [4] * 4
    state = torch.load(tmp_path / "mv" / "checkpoint.pt", weights_only=True)
    assert state["model"]["backbone.conv1.weight"].shape == (4, 2, 5, 7, 7)
