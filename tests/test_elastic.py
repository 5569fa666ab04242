"""Horovod Elastic: a rank killed with SIGKILL mid-epoch does not end the job, and its slot comes back.

One real ``horovodrun --gloo`` elastic job of ``trainer elastic``, three ranks on one machine as
three names of 127.0.0.1 (Horovod blacklists a whole host name when a rank on it dies, so each
slot is its own name), hosts from ``scripts/discover-hosts.sh``. Rank 0 is killed mid-epoch 0
(the hardest case: the new rank 0 must be a survivor, which holds the state), and its name
is taken out of the hosts file; the survivors roll back to their last commit and go on as two.
Once they train as two, they are paused (SIGSTOP) while the name is listed again and horovodrun's
discovery sees it after the name's blacklist cool-down; resumed, they admit a new rank at their next
commit. (Without the pause, on an idle machine the survivors could finish before the driver noticed.)

What is observed: the job's exit status; the clip log (every clip each rank trained on and a
digest of the weights it started from, step by step, before the step), from which each epoch's
effective clips must be exactly the split, each once, with every step a rollback undid replaced;
the clips each epoch summary in metrics.jsonl counts (the same: training totals are committed);
the weights at each step, equal on all ranks, and after the rollback equal to those the first
ring had at the step rolled back to; the world sizes the log shows (3, then 2, then 3 again);
and every final rank's weights (SHA-256 each prints), equal to each other and to the checkpoint's.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers.commandlines import parse, project_commands
from helpers.shardsets import make_shardset

from trainer import metrics
from trainer.clip_log import committed_clips, read, read_file, weights_digest

ROOT = Path(__file__).resolve().parents[1]
HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")
HOSTS = ["localhost", "127.0.0.1", "127.1"]  # one slot each, all 127.0.0.1 (no ssh)
CLIPS, BATCH, EPOCHS, COMMIT_EVERY = 144, 2, 2, 4
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
FINISHED = re.compile(r"rank (\d) of (\d): finished with .* weights sha256 (\w+)")


def write_hosts(path: Path, names) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{n}:1\n" for n in names))
    tmp.replace(path)  # the discovery script never reads half a file


def wait_for(proc: subprocess.Popen, log: Path, what: str, found, timeout: float = 180):
    """Poll ``found()`` until it returns something; fail if the job ends or time runs out first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = found()
        if result:
            return result
        assert proc.poll() is None, (f"the job ended (rc {proc.returncode}) before {what}: "
                                     f"{log.read_text()[-4000:]}")
        time.sleep(0.01)
    raise AssertionError(f"no {what} within {timeout} s: {log.read_text()[-4000:]}")


def rank0_mid_epoch(out: Path):
    """(host, pid) of rank 0's process, stopped (SIGSTOP) with its last logged step of the first
    epoch half-way between two commits: a kill there rolls the survivors back to a step the first
    ring logged, which the weights check below compares. A kill just after a commit would leave
    nothing to compare (the step after it not yet logged), so rank 0 runs on until it is half-way."""
    for path in (out / "clips").glob("*.jsonl"):
        host, pid = path.stem.rsplit("-", 1)
        if not any(r["rank"] == 0 and r["epoch"] == 1 and r["batch"] >= 2 for r in read_file(str(path))):
            continue
        os.kill(int(pid), signal.SIGSTOP)
        last = max(r["batch"] for r in read_file(str(path)) if r["rank"] == 0 and r["epoch"] == 1)
        if last % COMMIT_EVERY == COMMIT_EVERY // 2:
            return host, int(pid)
        os.kill(int(pid), signal.SIGCONT)
    return None


def survivors(out: Path) -> list[int]:
    """Pids of the processes that logged a step of the two-rank ring."""
    return [int(path.stem.rsplit("-", 1)[1]) for path in (out / "clips").glob("*.jsonl")
            if any(r["size"] == 2 for r in read_file(str(path)))]


def host_seen(calls: Path, written: float, back: float) -> bool:
    """Whether horovodrun's discovery has seen the name listed again once its cool-down was over:
    a run after ``back``, or a run after ``written`` followed by silence (the driver found the
    change and is blocked notifying the paused rank 0, so it runs no more discovery)."""
    times = [float(t) for t in calls.read_text().split()] if calls.exists() else []
    last = max(times, default=0.0)
    return last > back or (last > written and time.time() - last > 1.5)


# long: 50-80 s of a whole elastic job on 2 cores (a killed rank waits out the ring's failure, a
# re-formation, a host's return); the suite keeps the loader's resize and the partition tests
@pytest.mark.long
def test_rank_killed_mid_epoch_job_continues_and_its_slot_rejoins(tmp_path):
    data, out, hosts, log = tmp_path / "data", tmp_path / "run", tmp_path / "hosts.txt", tmp_path / "job.log"
    calls = tmp_path / "discovery-calls"
    manifest = make_shardset(str(data), {"train": CLIPS}, per_shard=6, num_classes=3, frames=4, size=(48, 40))
    split = Counter(k for shard in manifest.splits["train"].shards for k in shard.keys)
    write_hosts(hosts, HOSTS)
    proc = subprocess.Popen([
        HOROVODRUN, "-np", "3", "--min-np", "2", "--max-np", "3", "--gloo", "--gloo-timeout-seconds", "30",
        "--host-discovery-script",
        f"{ROOT / 'scripts' / 'discover-hosts.sh'} {hosts} && date +%s.%N >> {calls}",
        "--blacklist-cooldown-range", "1", "2",
        sys.executable, "-m", "trainer", "elastic", "--data", str(data), "--output-dir", str(out),
        "--val-split", "", "--segments", "4", "--depth", "10", "--width", "8", "--crop-size", "32",
        "--scale-size", "36", "--batch-size", str(BATCH), "--epochs", str(EPOCHS), "--warmup-epochs", "1",
        "--workers", "0", "--no-tensorboard", "--commit-every", str(COMMIT_EVERY), "--clip-log"],
        env=ENV, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        host, pid = wait_for(proc, log, "rank 0 in mid-epoch", lambda: rank0_mid_epoch(out))
        os.kill(pid, signal.SIGKILL)
        write_hosts(hosts, [h for h in HOSTS if h != host])  # back only when listed again
        paused = wait_for(proc, log, "a step of the two survivors", lambda: survivors(out))
        for survivor in paused:
            os.kill(survivor, signal.SIGSTOP)
        written = time.time()
        write_hosts(hosts, HOSTS)
        # the name was blacklisted before the survivors re-formed, for 2 s (the first cool-down of
        # --blacklist-cooldown-range 1 2); a discovery run after that lists it as available again
        back = written + 2.5
        wait_for(proc, log, "discovery of the listed name", lambda: host_seen(calls, written, back))
        time.sleep(0.5)  # the driver's notification of the new host reaches the paused rank 0 on resume
        for survivor in paused:
            os.kill(survivor, signal.SIGCONT)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = log.read_text()
    assert proc.returncode == 0, output[-4000:]
    assert "a rank failed; back to the last commit" in output

    # every epoch trained on every clip exactly once, the steps a rollback undid replaced
    clips = committed_clips(str(out))
    assert sorted(clips) == list(range(1, EPOCHS + 1))
    for epoch, seen in clips.items():
        assert seen == split, (epoch, seen - split, split - seen)
    # so did the epoch summaries: the totals the dead rank had committed survive, undone steps never count
    epochs = {r["epoch"]: r for r in metrics.read(str(out / "metrics.jsonl")) if r["event"] == "epoch"}
    assert sorted(epochs) == list(range(1, EPOCHS + 1))
    assert [round(r["clips_per_s"] * r["epoch_time"]) for r in epochs.values()] == [CLIPS] * EPOCHS, epochs
    # epochs are numbered from 1 everywhere: the rollback's and re-formations' log lines, the bar,
    # the training records of metrics.jsonl (each in the epoch whose record closes it) and the clip log
    said = [int(n) for n in re.findall(r"(?:back to the last commit, |ranks; )epoch (\d+)", output)]
    assert said and said[0] == 1 and set(said) <= set(range(1, EPOCHS + 1)), said
    assert {int(n) for n in re.findall(r"epoch (\d+)/%d" % EPOCHS, output)} == set(range(1, EPOCHS + 1))
    ends = [r["step"] for r in epochs.values()]
    trained = [r for r in metrics.read(str(out / "metrics.jsonl")) if r["event"] == "train"]
    assert trained and all(r["epoch"] == 1 + sum(r["step"] > end for end in ends) for r in trained), trained
    records = read(str(out))
    sizes = [r["size"] for r in sorted(records, key=lambda r: r["generation"])]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3
    assert len({(r["generation"], r["epoch"], r["batch"], r["rank"]) for r in records}) == len(records)
    assert len(list((out / "clips").glob("*.jsonl"))) == 4  # three first ranks and the one that joined

    # every step starts from the same weights on every rank, and the survivors' first step after
    # the kill from exactly the weights the first ring had at that step (the commit rolled back to)
    weights = {}
    for r in records:
        weights.setdefault((r["generation"], r["epoch"], r["batch"]), set()).add(r["weights"])
    assert all(len(w) == 1 for w in weights.values())
    first = {g: min((e, b) for h, e, b in weights if h == g) for g, _, _ in weights}
    restarts = [(weights[(g, *first[g])], weights[(h, *first[g])]) for g in first for h in first
                if h < g and (h, *first[g]) in weights]
    assert restarts and all(mine == earlier for mine, earlier in restarts)

    # three ranks at the end (one of them new), all with the checkpoint's weights
    finished = FINISHED.findall(output)
    assert sorted((int(r), int(n)) for r, n, _ in finished) == [(0, 3), (1, 3), (2, 3)], output[-4000:]
    model = torch.load(out / "checkpoint.pt", weights_only=True)["model"]
    learned = [(k, v) for k, v in model.items() if "running" not in k and "num_batches" not in k]
    assert {digest for _, _, digest in finished} == {weights_digest(learned)}


def test_the_commands_in_docs_elastic_parse():
    commands = project_commands((ROOT / "docs" / "elastic.md").read_text())
    assert ["trainer", "elastic"] in [argv[:2] for argv in commands]
    for argv in commands:
        parse(argv)
