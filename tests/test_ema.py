"""Weight EMA (``--ema-decay``, trainer/ema.py): the average of the weights the run really trained,
validated beside them, scored by ``trainer test --ema``, resumed bit for bit, and refused in one
line where it cannot combine."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer import cli, config, train
from trainer.hooks import Hook

DATA = Path(__file__).with_name("fixtures") / "checkpoint-v0" / "data"  # 8 training clips, 4 validation clips
FAULTRUN = str(Path(__file__).with_name("helpers") / "faultrun.py")
DECAY = 0.75
FLAGS = ["--backend", "none", "--segments", "4", "--depth", "10", "--width", "4", "--crop-size", "24",
         "--scale-size", "28", "--batch-size", "2", "--epochs", "2", "--warmup-epochs", "1",
         "--lr-per-8", "0.05", "--dropout", "0.5", "--workers", "1", "--print-freq", "1", "--no-tensorboard",
         "--ema-decay", str(DECAY)]


class Recorder(Hook):
    """The weights every step starts from and ends with, as the loop sees them."""

    def __init__(self):
        self.start, self.after = None, []

    def before_step(self, t, batch):
        if self.start is None:
            self.start = {k: v.clone() for k, v in t.engine.model.state_dict().items()}

    def after_step(self, t, step):
        self.after.append({k: v.clone() for k, v in t.engine.model.state_dict().items()})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of two epochs with the average: (its output directory, the loop's weights before the
    first step and after every step, the average at the end)."""
    out = tmp_path_factory.mktemp("ema")
    cfg = config.TrainConfig(
        data=config.Data(data=str(DATA), batch_size=2, workers=1, crop_size=24, scale_size=28),
        model=config.Model(segments=4, depth=10, width=4, dropout=0.5),
        recipe=config.Recipe(epochs=2, warmup_epochs=1, lr_per_8=0.05, ema_decay=DECAY),
        system=config.System(backend="none", output_dir=str(out), tensorboard=False, print_freq=1))
    t = train.Trainer(cfg)
    recorder = Recorder()
    t.hooks.append(recorder)
    try:
        assert train.train(t, train.StopFlag()) == 0
        ema = next(h for h in t.hooks if h.key == "ema")
        average = {k: v.clone() for k, v in ema.average.state_dict().items()}
    finally:
        t.close()
    assert ema.updates == 8
    return out, recorder, average


def test_the_average_is_the_running_average_of_the_trained_weights_and_is_validated(trained):
    out, recorder, average = trained
    assert len(recorder.after) == 8
    expected = dict(recorder.start)
    for weights in recorder.after:
        expected = {k: DECAY * expected[k] + (1 - DECAY) * w if w.is_floating_point() else w
                    for k, w in weights.items()}
    for key, value in expected.items():
        assert torch.allclose(average[key], value, rtol=1e-5, atol=1e-7), key
    # the average is not the last weights (the check above would not tell them apart otherwise)
    assert not torch.allclose(average["fc.weight"], recorder.after[-1]["fc.weight"])
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["event"] == "epoch"]
    assert [e["ema_val_samples"] for e in epochs] == [4, 4]
    assert epochs[-1]["ema_val_loss"] != epochs[-1]["val_loss"]


def test_trainer_test_scores_the_average_with_ema_and_refuses_a_checkpoint_without_one(
        trained, tmp_path, capsys):
    """``trainer test --ema`` scores exactly what a checkpoint holding the average as its weights
    scores, and not what the weights score; a checkpoint of a run without ``--ema-decay`` is
    refused in one line."""
    out, _, average = trained
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert all(torch.equal(v, average[k]) for k, v in state["hooks"]["ema"]["weights"].items())
    as_weights = tmp_path / "as-weights"
    as_weights.mkdir()
    torch.save({**state, "model": state["hooks"]["ema"]["weights"], "hooks": {}}, as_weights
               / "checkpoint.pt")

    def scored(run, *flags):
        report = tmp_path / "report.json"
        assert cli.main(["test", "--checkpoint", str(run), "--data", str(DATA), "--backend", "none",
                         "--workers", "0", "--output", str(report), *flags]) == 0
        return json.loads(report.read_text())

    ema, plain, reference = scored(out, "--ema"), scored(out), scored(as_weights)
    assert ema["videos"] == reference["videos"] and ema["videos"] != plain["videos"]
    assert ema["summary"]["ema"] is True and "ema" not in plain["summary"]
    capsys.readouterr()
    assert cli.main(["test", "--checkpoint", str(as_weights), "--data", str(DATA), "--backend", "none",
                     "--ema"]) == 1
    assert capsys.readouterr().err == (f"trainer test: error: {as_weights / 'checkpoint.pt'}: --ema: the "
                                       "checkpoint keeps no weight average (its run had no --ema-decay)\n")


def run(out, fault="", *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, FAULTRUN, "train", "--data", str(DATA), "--output-dir", str(out),
                           *FLAGS, *extra], env={**os.environ, "OMP_NUM_THREADS": "1", "FAULT": fault},
                          capture_output=True, text=True, timeout=300)


def records(out) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if "time" not in k and k != "clips_per_s"}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.long  # three trainer processes: 66-87 s at load 17-22 on 2 cores
def test_a_stopped_run_resumes_its_average_bit_for_bit(tmp_path):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    assert run(straight).returncode == 0
    stopped = run(broken, "step:3:TERM:self")
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert torch.load(broken / "checkpoint.pt", weights_only=True)["hooks"]["ema"]["updates"] == 3
    resumed = run(broken, "", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = torch.load(straight / "checkpoint.pt", weights_only=True)["hooks"]["ema"]
    b = torch.load(broken / "checkpoint.pt", weights_only=True)["hooks"]["ema"]
    assert a["updates"] == b["updates"] == 8
    for key, value in a["weights"].items():
        assert torch.equal(value, b["weights"][key]), key
    assert records(broken) == records(straight)


@pytest.mark.parametrize("flags, message", [
    (["--average-every", "2"], "trainer train: error: --ema-decay averages one model's weights, and K-step "
                               "averaging's ranks hold different ones between synchronisations: not with "
                               "--average-every"),
    (["--ema-decay", "1"], "trainer train: error: --ema-decay must be in [0, 1) (0: off), not 1.0"),
])
def test_what_cannot_combine_is_refused_in_one_line(tmp_path, flags, message, capsys):
    assert cli.main(["train", "--data", str(DATA), "--output-dir", str(tmp_path), *FLAGS, *flags]) == 1
    assert capsys.readouterr().err == message + "\n"
