"""What the long stage's replica tests share (tests/test_replicas_faults.py, tests/test_replicas_outage.py):
a replica on a port of its own, a two-rank training run (``horovodrun -np 2 --gloo`` of
tests/helpers/faultrun.py) reading through nginx, holding it at a step of rank 0's (SIGSTOP to every process
of the job) and letting it go, and the proof that a run disturbed by faults trained what an
undisturbed one did, bitwise."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import torch

from helpers.fronts import Front, free_port
from helpers.shardsets import ServiceProcess, http
from trainer.clip_log import read_file

HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")
FAULTRUN = str(Path(__file__).with_name("faultrun.py"))
CLIPS, BATCH, EPOCHS = 24, 2, 2
FLAGS = ["--segments", "4", "--depth", "10", "--width", "8", "--crop-size", "32", "--scale-size", "36",
         "--batch-size", str(BATCH), "--warmup-epochs", "0.5", "--workers", "1", "--print-freq", "1",
         "--no-tensorboard", "--clip-log", "--epochs", str(EPOCHS), "--val-split", ""]


class Replica(ServiceProcess):
    """A replica on a port of its own (restarted, it is where nginx looks for it)."""

    def __init__(self, *args: str):
        self.port = free_port()
        super().__init__(*args, "--port", str(self.port), "--max-connections-per-client", "0")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stats(self) -> dict:
        return json.loads(http(self.url, path="/v1/stats")[2])["total"]


@contextlib.contextmanager
def replicated(root: Path, *args: str, count: int = 2):
    """``count`` replicas started with ``args``, behind a ``Front`` (in ``root/nginx``): (replicas, front),
    all stopped on every path."""
    replicas, front = [], None
    try:
        replicas = [Replica(*args) for _ in range(count)]
        for r in replicas:
            r.start()
        front = Front(root / "nginx", [r.address for r in replicas]).start()
        yield replicas, front
    finally:
        if front is not None:
            front.stop()
        for r in replicas:
            r.kill(signal.SIGTERM)


def train(data: str, out: Path, env: dict | None = None, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, FAULTRUN,
                             "train", "--data", data, "--output-dir", str(out), *FLAGS, *flags],
                            env={**os.environ, "OMP_NUM_THREADS": "1", "EXIT_LOG": str(out / "exits"),
                                 **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


class HeldRun:
    """A ``train`` run with ``FAULT`` holds, its output read as it comes (``log``); ``held(step)`` waits
    until the job is held at rank 0's ``step``, ``go_on(step)`` lets it go and waits until it is past it."""

    def __init__(self, data: str, out: Path, holds: list[int], env: dict | None = None, *flags: str):
        self.out, self.output = out, []
        self.proc = train(data, out, {"FAULT": ",".join(f"step:{n}:STOP:job" for n in holds), **(env or {})},
                          *flags)
        self.reader = threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    @property
    def log(self) -> str:
        return "".join(self.output)

    def held(self, step: int, seconds: float = 300) -> None:
        deadline = time.monotonic() + seconds
        while not ranks_stopped(self.proc):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log[-3000:]
            time.sleep(0.05)
        # held exactly there: its record written, the step not run
        assert steps_logged(self.out, rank=0) == step

    def go_on(self, step: int, seconds: float = 300) -> None:
        deadline = time.monotonic() + seconds
        signal_job(self.proc, signal.SIGCONT)
        while steps_logged(self.out, rank=0) == step:  # under way again
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log[-3000:]
            time.sleep(0.05)

    def wait(self, seconds: float = 600) -> int:
        try:
            return self.proc.wait(timeout=seconds)
        finally:
            self.kill()

    def kill(self) -> None:
        signal_job(self.proc, signal.SIGKILL)  # whatever of the job is left
        self.reader.join(timeout=60)


def job(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        top = psutil.Process(proc.pid)
        return [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def ranks_stopped(proc: subprocess.Popen) -> bool:
    """Whether the job's ranks (and their loader workers) are all held by the SIGSTOP faultrun sent
    every process of the job."""
    states = []
    for p in job(proc):
        try:
            if "faultrun.py" in " ".join(p.cmdline()):
                states.append(p.status())
        except psutil.Error:  # gone, or a zombie (faultrun's own `kill`)
            continue
    return len(states) >= 2 and all(s == psutil.STATUS_STOPPED for s in states)


def signal_job(proc: subprocess.Popen, signum: int) -> None:
    for p in job(proc):
        try:
            p.send_signal(signum)
        except psutil.Error:
            continue


def steps_logged(out: Path, rank: int) -> int:
    """How many steps ``rank`` has logged (a step's record is written as it starts)."""
    return sum(r["rank"] == rank for path in (out / "clips").glob("*.jsonl") for r in read_file(str(path)))


def steps_by_epoch(out: Path) -> dict[int, list[dict]]:
    records = [r for path in (out / "clips").glob("*.jsonl") for r in read_file(str(path))]
    return {e: sorted((r for r in records if r["epoch"] == e), key=lambda r: (r["step"], r["rank"]))
            for e in range(1, EPOCHS + 1)}


def assert_trained_alike(calm: Path, faults: Path, keys: list[str]) -> None:
    """Both runs ended well on both ranks, every clip trained once per epoch, the weights at every step
    and at the end bitwise equal."""
    for out in (calm, faults):
        assert [json.loads(line)["exit"] for r in (0, 1)
                for line in (out / f"exits.rank{r}.jsonl").read_text().splitlines()] == [0, 0]
    calm_steps, fault_steps = steps_by_epoch(calm), steps_by_epoch(faults)
    for epoch in range(1, EPOCHS + 1):
        trained = Counter(k for record in fault_steps[epoch] for k in record["keys"])
        assert trained == Counter(keys), f"epoch {epoch}: not every clip once"
        assert [r["weights"] for r in fault_steps[epoch]] == [r["weights"] for r in calm_steps[epoch]]
    a = torch.load(calm / "checkpoint.pt", map_location="cpu", weights_only=False)
    b = torch.load(faults / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert (a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k])
                                                           for k in a["model"]))
