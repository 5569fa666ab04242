"""A two-rank training run (horovodrun -np 2, Gloo, 127.0.0.1) reading its shards from the dataset
service (``shard-service serve``) while the service is down: restarted three times mid-run, each
outage longer than the old client's 4 s of retries, the run pauses and finishes with the weights
of an undisturbed run, by byte ranges and through a node cache; kept down past the run's
``--source-deadline``, the run stops as on SIGTERM (position saved mid-epoch, one line per rank,
exit status 75) and ``--resume`` continues at that batch to the same weights.

The restarts are timed by the run's progress, not by the clock: the service runs under
``tests/helpers/holdpoint.py``, which freezes it at its n-th file request (a request of the run is then
certainly in flight); the harness kills it there (SIGKILL: the request is cut), keeps it down for
``OUTAGE`` seconds (the outage's length, not a guess at timing) and starts it again on the same
port. Where the holds fall comes from the access log of the undisturbed run: the k-th file request
it answered (the holds only come earlier in a disturbed run, whose cut requests are asked again);
through a node cache, from the set itself: the manifest, then each shard's copy once.
"""
from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers.shardsets import make_shardset, register

from shards.catalog import Catalog
from shards.format.manifest import Manifest
from trainer.clip_log import read_file

pytestmark = pytest.mark.long

HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")
TESTS = Path(__file__).parent
OUTAGE = 6.0  # seconds each restart keeps the service down: longer than the old 5 tries in ~4 s
CLIPS, VAL, BATCH, EPOCHS = 48, 8, 2, 2
STEPS = CLIPS // (2 * BATCH)  # per epoch, on 2 ranks
# (a shuffle buffer of 2 clips: a loader worker reads its shards as its batches need them, not its
# whole share of the epoch before its first batch, so that a run through a node cache downloads
# copies all through the epoch)
FLAGS = ["--shuffle", "global", "--shuffle-buffer", "2", "--segments", "4", "--depth", "10", "--width", "8",
         "--crop-size", "32",
         "--scale-size", "36", "--batch-size", str(BATCH), "--epochs", str(EPOCHS), "--warmup-epochs", "0.5",
         "--lr-per-8", "0.4", "--workers", "1", "--lookahead", "1", "--print-freq", "1", "--no-tensorboard",
         "--clip-log"]


class Service:
    """``shard-service serve --access-log`` on a fixed port of 127.0.0.1, optionally frozen at its
    ``hold``-th file request (``tests/helpers/holdpoint.py``); ``log`` collects its output."""

    def __init__(self, root: Path, port: int, hold: int | None = None):
        self.port, self.log = port, []
        command = [sys.executable, "-m", "service", "serve", "--catalog", str(root / "catalog.sqlite"),
                   "--port", str(port), "--access-log"]
        env = dict(os.environ)
        self.held_r = None
        if hold:
            self.held_r, held_w = os.pipe()
            command[1:1] = [str(TESTS / "helpers" / "holdpoint.py"), f"service.api.views:open_file@{hold}"]
            env |= {"HOLD_FD": str(held_w)}
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, pass_fds=[held_w] if hold else [])
        if hold:
            os.close(held_w)
        while not (line := self.proc.stdout.readline()).startswith("serving "):
            self.log.append(line)
            assert line, "the service exited: " + "".join(self.log)
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()

    def wait_held(self, run: subprocess.Popen, timeout: float = 240) -> None:
        """Until the service is frozen at its hold (failing if the run ends first, or never gets there)."""
        deadline = time.monotonic() + timeout
        while not select.select([self.held_r], [], [], 0.2)[0]:
            assert run.poll() is None, f"the run ended (exit {run.returncode}) before the service's hold"
            assert time.monotonic() < deadline, "the service never reached its hold"
        assert os.read(self.held_r,
                       5) == b"held\n", "the service exited before its hold: " + "".join(self.log)

    def kill(self, signum: int = 9) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        self.proc.wait(timeout=60)
        if self.held_r is not None:
            os.close(self.held_r)
            self.held_r = None

    def file_requests(self) -> list[str]:
        return [line.split('"GET ', 1)[1].split()[0] for line in self.log
                if '"GET /v1/datasets/tiny/' in line]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_run(port: int, out: Path, *extra: str) -> subprocess.Popen:
    """``trainer train`` on two ranks (through ``tests/helpers/faultrun.py``, which records each rank's
    exit)."""
    return subprocess.Popen([HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                             str(TESTS / "helpers" / "faultrun.py"), "train", "--data",
                             f"http://127.0.0.1:{port}/v1/datasets/tiny",
                             "--output-dir", str(out), *FLAGS, *extra],
                            env={**os.environ, "OMP_NUM_THREADS": "1", "EXIT_LOG": str(out) + "-exits"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(run: subprocess.Popen, timeout: float = 600) -> str:
    try:
        return run.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, 9)
        raise


def exits(out: Path) -> dict[int, list[int]]:
    return {r: [json.loads(line)["exit"]
                for line in Path(f"{out}-exits.rank{r}.jsonl").read_text().splitlines()]
            for r in (0, 1)}


def weights(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", weights_only=True)


def assert_same_weights(a: dict, b: dict, bn_statistics: bool = True) -> None:
    """The two runs' final checkpoints hold the same weights and optimizer state, bit for bit, and
    the same BN running statistics unless ``bn_statistics`` is False."""
    assert (a["clips_seen"] == b["clips_seen"] == EPOCHS * CLIPS and (a["epoch"],
                                                                      b["epoch"]) == (EPOCHS, EPOCHS))
    for key, value in a["model"].items():
        if bn_statistics or not key.endswith(("running_mean", "running_var")):
            assert torch.equal(value, b["model"][key]), key
    for index, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][index]["momentum_buffer"]), index


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The shard set registered in a catalog, and the undisturbed run through the service: its
    weights, and the file requests it made."""
    root = tmp_path_factory.mktemp("outage")
    make_shardset(str(root / "data"), {"train": CLIPS, "val": VAL}, per_shard=4, num_classes=3, frames=4,
                  size=(48, 40))
    register(Catalog(str(root / "catalog.sqlite")), str(root / "data"), "tiny")
    port = free_port()
    service = Service(root, port)
    try:
        run = start_run(port, root / "straight")
        output = finish(run)
        assert run.returncode == 0, output[-4000:]
    finally:
        service.kill(15)
    shards = sum(len(split.shards) for split in Manifest.load(str(root / "data")).splits.values())
    return {"root": root, "port": port, "straight": weights(root / "straight"),
            "requests": service.file_requests(),
            "copies": 1 + shards}


def ride_through(served, name: str, holds: list[int], *extra: str) -> tuple[str, Path]:
    """The run of ``extra`` flags while the service is restarted at each of its ``holds`` (file
    requests, counted over the run), each time kept down ``OUTAGE`` seconds; its output and directory."""
    root, port, out = served["root"], served["port"], served["root"] / name
    local = [holds[0]] + [b - a + 1 for a, b in zip(holds, holds[1:])]  # (+1: the cut request is asked again)
    service = Service(root, port, local[0])
    run = start_run(port, out, *extra)
    try:
        for k in range(len(holds)):
            service.wait_held(run)
            service.kill(9)
            time.sleep(OUTAGE)  # the outage itself
            service = Service(root, port, local[k + 1] if k + 1 < len(holds) else None)
        output = finish(run)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, 9)
        service.kill(15)
    return output, out


def ranks_output(output: str) -> str:
    """What the ranks printed (horovodrun prefixes it with [rank]), without horovodrun's own lines."""
    return "".join(line for line in output.splitlines(keepends=True) if line[:1] == "[")


def waits(output: str) -> tuple[int, int]:
    """Waits for the source begun and ended, over every process of the run (one line each)."""
    return output.count("is not answering ("), output.count("answers again, after ")


@pytest.mark.parametrize("cache", [False, True], ids=["byte-ranges", "node-cache"])
def test_a_run_rides_through_three_service_restarts_to_the_undisturbed_weights(served, cache):
    # the file requests of the undisturbed run: the manifest and every shard range, or every copy
    requests = served["copies"] if cache else len(served["requests"])
    holds = [2, requests // 2, requests - 1]
    extra = ["--cache-dir", str(served["root"] / "cache")] if cache else []
    output, out = ride_through(served, "cached" if cache else "ranges", holds, *extra)
    assert "Traceback" not in output and exits(out) == {0: [0], 1: [0]}, output[-4000:]  # (horovodrun's too)
    begun, ended = waits(output)
    assert begun >= 3 and begun == ended, output[-4000:]  # every wait ended with an answer, none gave up
    assert_same_weights(served["straight"], weights(out))


# The file requests of a run through a node cache: the manifest, the 12 training shards (each
# downloaded as the batches its loader worker makes ahead need it, one ahead: about 7 requests by
# the first step, the rest through the epoch), then the 2 validation shards (epoch 1's
# validation). By byte ranges, each loader worker reads its epoch's ranges ahead as it starts.
@pytest.mark.parametrize("hold, where", [(2, "start"), (10, "training"), (14, "validation")])
def test_past_the_deadline_the_run_stops_as_on_a_signal_with_75_and_resumes_there(served, hold, where):
    """The service is killed at a file request as epoch 1 starts (byte ranges: every range of the
    epoch is then still to come), mid-way through its training or as its validation starts
    (through a node cache), and kept down past the run's 3 s deadline: every rank stops after the
    same step, the position saved (the batch that could not be read, or the validation, still to
    do), one line and exit status 75 on each rank; with the service back, --resume goes on there."""
    root, port, out = served["root"], served["port"], served["root"] / f"deadline-{where}"
    flags = ["--source-deadline", "3", *(["--cache-dir", str(root / f"cache-{where}")] if where != "start"
                                         else [])]
    service = Service(root, port, hold=hold)
    run = start_run(port, out, *flags)
    try:
        service.wait_held(run)
        service.kill(9)
        output = finish(run)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, 9)
    assert exits(out) == {0: [75], 1: [75]}, output[-4000:]
    assert "Traceback" not in ranks_output(output), output[-4000:]
    stopped = torch.load(out / "checkpoint.pt", weights_only=True)
    batch = stopped["batch"]
    assert stopped["epoch"] == 0 and stopped["loader"]["samples_consumed"] == batch * BATCH
    assert {"start": batch == 0, "training": 0 < batch < STEPS, "validation": batch == STEPS}[where], batch
    lines = [line for line in output.splitlines() if "error:" in line]
    assert sorted(line[:3] for line in lines) == ["[0]", "[1]"], output[-4000:]  # one line on each rank
    place = "during its validation" if where == "validation" else f"after batch {batch}"
    for line in lines:
        assert "trainer train: error: rank " in line and "no answer for " in line and (
            "past the source deadline of 3 s (--source-deadline, $SHARD_SOURCE_DEADLINE); last: "
            in line), line
        assert line.endswith(f"stopped in epoch 1 {place} (step {batch}, {batch * 2 * BATCH} clips seen), "
                             f"checkpoint saved to {out / 'checkpoint.pt'}: once the source answers, the "
                             "same command with --resume continues from there"), line
    first = [r for p in (out / "clips").glob("*.jsonl") for r in read_file(str(p))]
    # the batch that could not be read: not trained
    assert max((r["batch"] for r in first), default=-1) == batch - 1

    service = Service(root, port)
    try:
        resumed = start_run(port, out, *flags, "--resume")
        output = finish(resumed)
    finally:
        service.kill(15)
    assert exits(out) == {0: [75, 0], 1: [75, 0]}, output[-4000:]
    # checkpoint.position
    resumed_at = f"in epoch 1, after batch {batch}" if batch else "at the start of epoch 1"
    assert f"resumed from {out / 'checkpoint.pt'} {resumed_at} (step {batch}," in output
    records = [r for p in (out / "clips").glob("*.jsonl") for r in read_file(str(p))]
    after = [r for r in records if r not in first]
    assert min((r["epoch"], r["batch"]) for r in after) == ((2, 0) if where == "validation" else (1, batch))
    for epoch in range(1, EPOCHS + 1):  # every clip once per epoch, over the two runs
        trained = Counter(k for r in records if r["epoch"] == epoch for k in r["keys"])
        assert len(trained) == CLIPS and set(trained.values()) == {1}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # epoch 1 validated once, on resume
    assert [r["epoch"] for r in metrics if r["event"] == "epoch"] == [1, 2]
    # Resumed mid-epoch on 2 ranks, rank 1's BN running statistics start from rank 0's (the
    # checkpoint holds rank 0's model; within an epoch the ranks' statistics differ, until its end
    # averages them), as after any mid-epoch stop of several ranks, a signal's too: they differ;
    # the weights and the optimizer state do not.
    assert_same_weights(served["straight"], weights(out), bn_statistics=where != "training")


def test_a_corrupt_sample_stops_the_run_at_its_batch_and_resume_after_the_repair_goes_on_there(tmp_path):
    """The same stop for any ``DataFault`` of the loader, raised in a loader worker: a sample whose
    bytes differ from the manifest's digest (``CorruptSample``, no skip budget) ends the run after
    the batch before it with the position saved, one line naming the shard, the sample and both
    digests, exit status 1; once the shard is repaired, ``--resume`` goes on at that batch and
    ends with the weights of a run that never met it."""
    data = tmp_path / "data"
    manifest = make_shardset(str(data), {"train": 24, "val": 4}, per_shard=4, num_classes=3, frames=4,
                             size=(48, 40))
    shard = manifest.splits["train"].shards[3]
    path, at = data / shard.name, shard.offsets[2] + shard.lengths[2] // 2  # inside its third sample
    whole = path.read_bytes()
    flags = ["--backend", "none", *FLAGS[:FLAGS.index("--batch-size")], "--batch-size", "4",
             *FLAGS[FLAGS.index("--epochs"):]]

    def train(out, *extra):
        return subprocess.run([sys.executable, "-m", "trainer", "train", "--data", str(data), "--output-dir",
                               str(out), *flags, *extra], env={**os.environ, "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True, timeout=600)

    straight = train(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    path.write_bytes(whole[:at] + bytes([whole[at] ^ 0xFF]) + whole[at + 1:])  # size kept
    broken = train(tmp_path / "run")
    assert broken.returncode == 1 and "Traceback" not in broken.stderr, broken.stderr[-3000:]
    errors = [line for line in broken.stderr.splitlines() if ": error: " in line]
    stopped = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    batch = stopped["batch"]
    assert len(errors) == 1 and errors[0].startswith(f"trainer train: error: {data / shard.name}: shard "
                                                     f"{shard.name}, sample {shard.keys[2]}: "), errors
    assert shard.digests[2] in errors[0] and errors[0].endswith(
        f"stopped in epoch 1 after batch {batch} (step {batch}, {4 * batch} clips seen), checkpoint saved to "
        f"{tmp_path / 'run' / 'checkpoint.pt'}: the same command with --resume continues from there once "
        "that is repaired"), errors[0]
    trained = [k for r in read_file(str(next((tmp_path / "run" / "clips").glob("*.jsonl"))))
               for k in r["keys"]]
    assert shard.keys[2] not in trained and len(trained) == 4 * batch

    path.write_bytes(whole)
    resumed = train(tmp_path / "run", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{f'in epoch 1, after batch {batch}' if batch else 'at the start of epoch 1'} (step {batch}," in \
        resumed.stderr
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "run")
    assert a["clips_seen"] == b["clips_seen"] == EPOCHS * 24
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
