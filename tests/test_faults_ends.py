"""Every end is one line and leaves nothing half-written (docs/faults.md): full disks, Ctrl-C, a
damaged checkpoint, output into a closed pipe.

Each fault is real: a full disk is a tmpfs of a few pages (mounted per test, resized to give room
back, unmounted at the end also when the test fails), Ctrl-C is SIGINT to the command's process
group at a hold point (``tests/helpers/holdpoint.py``), a closed pipe is one whose reader is gone before
the command writes. Each test drives the console command and asserts its one line, its exit
status, what it left on disk, and that the same command run again (with room) continues.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import media
from helpers.shardsets import make_shardset

from ingest.cli import main as ingest
from shards.base.errors import Interrupted
from shards.format.manifest import Manifest

BIN = os.path.dirname(sys.executable)  # the console scripts beside this Python
HOLDPOINT = str(Path(__file__).with_name("helpers") / "holdpoint.py")
PAGE = 4096  # tmpfs counts whole pages
TEMPORARY = re.compile(r"\.tmp-[0-9a-f]{8}$")
TRAIN = ["--backend", "none", "--segments", "4", "--depth", "10", "--width", "4", "--crop-size", "32",
         "--scale-size", "36", "--batch-size", "3", "--epochs", "1", "--warmup-epochs", "0", "--workers", "0",
         "--no-tensorboard"]


@pytest.fixture
def disk(tmp_path):
    """``disk(nbytes)``: a tmpfs of that size (again: resized, as freeing space on a full disk is),
    unmounted when the test ends, whatever its outcome."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = []

    def mount(nbytes: int) -> Path:
        size = -(-nbytes // PAGE) * PAGE
        options = ("remount," if mounted else "") + f"size={size}"
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True)
        mounted.append(size)
        return where

    yield mount
    if mounted:
        subprocess.run(["umount", "-l", str(where)], check=True)


def pages(files) -> int:
    """Bytes ``files`` take on a tmpfs."""
    return sum(-(-p.stat().st_size // PAGE) * PAGE for p in files if p.is_file())


def shards(out: Path) -> list[Path]:
    return sorted(p for split in ("train", "val") for p in (out / split).glob("*.tar"))


def temporaries(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if TEMPORARY.search(p.name)]


def error_line(stderr: str) -> str:
    """The command's one error line; none other, and no traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


def staged_batches_are_whole(out: Path) -> int:
    """Every staged batch marked done by its index (written last) has its samples, whole, and
    nothing but batch files is there (a batch whose index write failed may leave its samples
    alone: not done, decoded again); -> the batches done."""
    stage = out / ".staging"
    names = {p.name for p in stage.iterdir()} if stage.exists() else set()
    tars, indexes = {n[:-4] for n in names if n.endswith(".tar")}, {n[:-5] for n in names
                                                                    if n.endswith(".json")}
    assert (indexes <= tars and names == {f"{b}.tar" for b in tars}
            | {f"{b}.json" for b in indexes}), sorted(names)
    for batch in indexes:
        index = json.loads((stage / f"{batch}.json").read_text())
        end = max((s["offset"] + s["length"] for v in index["videos"] for s in v["samples"]), default=0)
        assert (stage / f"{batch}.tar").stat().st_size == end, batch
    return len(indexes)


def same_set(a: Path, b: Path) -> None:
    assert (a / "manifest.json").read_bytes() == (b / "manifest.json").read_bytes()
    names = [p.relative_to(a) for p in shards(a)]
    assert names and names == [p.relative_to(b) for p in shards(b)]
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    """12 tiny videos in class folders: 10 train, 2 val."""
    root = tmp_path_factory.mktemp("videos")
    for i in range(12):
        split, label = ("val", "a") if i >= 10 else ("train", "ab"[i % 2])
        media.make_video(root / split / label / f"v{i:02d}.mp4", frames=12, width=64, height=48)
    return root


def build_args(src: Path, out: Path) -> list[str]:
    return ["build", "--src", str(src), "--out", str(out), "--frames", "4", "--short-side", "32",
            "--workers", "2", "--videos-per-task", "2", "--shard-samples", "3"]


def test_a_full_disk_while_ingest_stages_or_packs_is_one_line_and_the_rerun_continues(
        ray_local, videos, tmp_path, disk, capsys):
    """Before: a 49-line RayTaskError with raw colour codes, and a ``.tar.tmp-*`` left behind."""
    reference = tmp_path / "reference"
    assert ingest([*build_args(videos, reference), "--keep-staging"]) == 0
    staged, packed = pages((reference / ".staging").iterdir()), pages(shards(reference))
    capsys.readouterr()

    out = disk(staged // 2) / "out"  # staging does not fit
    assert ingest(build_args(videos, out)) == 1
    line = error_line(capsys.readouterr().err)
    done = staged_batches_are_whole(out)
    assert 0 < 2 * done < 12 and not temporaries(out.parent) and not shards(out)
    stage = re.escape(f"{out}/.staging")
    said = re.fullmatch(rf"ingest build: error: {stage}/[0-9a-f]+\.(tar|json): no space left on device: the "
                        rf"write needs [\d,]+ bytes, [\d,]+ are free; (\d+) of 12 videos are staged in "
                        rf"{stage}: once there is room, the same command continues from them", line)
    assert said and int(said[2]) <= 2 * done, line  # (a task cancelled as it finished may have staged more)

    disk(staged + PAGE * 8)  # room for staging, not for the shards beside it: refused before any is written
    assert ingest(build_args(videos, out)) == 1
    line = error_line(capsys.readouterr().err)
    assert (f"{out}: no room for the shards: they need " in line
            and "(the staged samples are deleted only once" in line)
    assert line.endswith(f"all 12 videos are staged in {out}/.staging: once there is room, the same command "
                         "packs them into shards again, decoding nothing"), line
    assert staged_batches_are_whole(out) >= 6 and not temporaries(out.parent) and not shards(out)
    assert packed > PAGE * 8

    disk(staged + packed + PAGE * 16)
    assert ingest(build_args(videos, out)) == 0
    same_set(reference, out)
    assert not (out / ".staging").exists() and not temporaries(out.parent)


@pytest.mark.parametrize("stop, cancelled", [(ValueError, False), (KeyboardInterrupt, True)])
def test_a_refusal_lets_the_ray_tasks_in_flight_finish_and_ctrl_c_cancels_them(
        ray_local, tmp_path, monkeypatch, stop, cancelled):
    """A driver stopped by a task's refusal (here any exception but Ctrl-C) waits for its tasks in
    flight without cancelling them: cancelling a task as its result arrives aborts the driver in Ray
    2.60 (a RAY_CHECK in its TaskManager), which once took this file's pytest worker down with the
    full-disk test above. Ctrl-C asks Ray to cancel them, then waits for them too. The calls to
    ``ray.cancel`` are recorded on their way to Ray. Ray's cancel is a KeyboardInterrupt in the task
    and best effort (ray-project/ray#32954; a suite run saw one never land), so the
    task, which waits for a file and then marks itself done, or marks itself interrupted, is let go
    2 s after the cancel was asked for (after a refusal, 2 s after the stop): either way
    ``in_flight`` must return only once the task has ended."""
    from ingest.tasks.ray_runtime import in_flight

    started, release, done, interrupted = (tmp_path / n for n in ("started", "release", "done",
                                                                  "interrupted"))

    def hold():
        with started.open("a") as f:
            f.write(f"attempt in pid {os.getpid()}, SIGINT {signal.getsignal(signal.SIGINT)}\n")
        try:
            deadline = time.monotonic() + 60
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        except KeyboardInterrupt:
            interrupted.touch()
            raise
        done.touch()

    timers, cancels, real_cancel = [], [], ray_local.cancel

    def release_in_2_s():
        timers.append(threading.Timer(2.0, release.touch))
        timers[-1].start()

    def cancel(ref, **options):
        cancels.append(ref)
        real_cancel(ref, **options)
        release_in_2_s()

    monkeypatch.setattr(ray_local, "cancel", cancel)
    ref = ray_local.remote(hold).remote()
    for _ in range(3000):
        if started.exists():
            break
        time.sleep(0.02)
    assert started.exists()
    try:
        if not cancelled:
            release_in_2_s()
        with pytest.raises(stop), in_flight([ref]):
            raise stop()
        ended = (interrupted.exists(), done.exists())  # as in_flight returned: the task had ended
        assert cancels == ([ref] if cancelled else []), started.read_text()
        assert ended in ([(True, False), (False, True)] if cancelled
                         else [(False, True)]), (ended, started.read_text())
    finally:
        for timer in timers:
            timer.cancel()
            timer.join()
        release.touch()  # whatever happened, the task is let go


def as_from_a_shell() -> None:
    """In the child before exec: no signal blocked and SIGINT's default action, as a terminal's
    shell starts a command. This pytest process may have either changed by then (a library's
    thread mask, an ignored SIGINT: both survive exec), and Ctrl-C would then never reach the build."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def left_in_session(sid: int) -> list[str]:
    """The processes of session ``sid`` (a command started with ``start_new_session``) still running
    10 s after its leader ended (time for its helpers to see it gone), named."""
    import psutil

    members = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(OSError, psutil.Error):
            if os.getsid(p.pid) == sid:
                members.append(p)
    _, alive = psutil.wait_procs(members, timeout=10)
    return [f"{p.pid} {' '.join(p.info['cmdline'] or [])[:200]}" for p in alive]


@pytest.mark.parametrize("runner", ["ray", "local"])
def test_ctrl_c_during_an_ingest_build_is_one_line_and_the_rerun_continues(request, videos, tmp_path, runner):
    """SIGINT to the build's process group as it has the result of its 2nd task (one counted): the
    driver cancels its tasks in flight and says what is staged. Before: 25 lines from inside Ray.
    On Ray (the cluster of --address), and in the local worker processes of a build without one,
    which ignore SIGINT and are stopped by the driver (ingest.tasks.local_runtime)."""
    out = tmp_path / "out"
    hold, held = os.pipe()
    on = (["ingest.tasks.ray_runtime:result@2", "--address",
           request.getfixturevalue("ray_local").get_runtime_context()
           .gcs_address] if runner == "ray" else ["ingest.tasks.local_runtime:LocalTasks.result@2"])
    # a file, not a pipe: a process the build leaves need not close it for us to read it
    log = tmp_path / "stderr"
    with open(log, "w") as err:
        build = subprocess.Popen([sys.executable, HOLDPOINT, on[0], "-m", "ingest",
                                  *build_args(videos, out), *on[1:]],
                                 env={**os.environ, "HOLD_FD": str(held)}, pass_fds=(held,),
                                 stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                                 preexec_fn=as_from_a_shell)
    os.close(held)
    try:
        with os.fdopen(hold) as f:
            assert f.readline() == "held\n"
        os.killpg(build.pid, signal.SIGINT)
        try:
            build.wait(timeout=120)
        except subprocess.TimeoutExpired:  # where every thread of it is, for the failure's message
            masks = [line for line in Path(f"/proc/{build.pid}/status").read_text().splitlines()
                     if line.startswith(("SigBlk", "SigIgn", "SigCgt"))]
            build.send_signal(signal.SIGUSR1)
            time.sleep(2)
            pytest.fail(f"no end 120 s after SIGINT ({masks}):\n" + log.read_text()[-8000:])
    finally:
        build.kill()
        build.wait()
    stderr = log.read_text()
    assert build.returncode == Interrupted.status == 130, stderr[-3000:]
    assert not (left := left_in_session(build.pid)), left  # nothing of the build left running
    assert error_line(stderr) == (f"ingest build: error: interrupted; 2 of 12 videos are staged in "
                                  f"{out}/.staging: the same command continues from them")
    assert staged_batches_are_whole(out) >= 1 and not temporaries(out)

    assert ingest(build_args(videos, out)) == 0
    assert ingest(build_args(videos, tmp_path / "clean")) == 0
    same_set(tmp_path / "clean", out)


def test_output_into_a_closed_pipe_ends_quietly_as_cat_does(tmp_path):
    """``shards stats SET | head -1``, the reader gone before the command writes. Before: a
    BrokenPipeError traceback and status 1."""
    make_shardset(str(tmp_path / "set"), {"train": 4}, per_shard=2)
    for argv in (["shards", "stats", str(tmp_path / "set")], ["shards", "plan", str(tmp_path / "set")]):
        read, write = os.pipe()
        os.close(read)
        try:
            p = subprocess.run([os.path.join(BIN, argv[0]), *argv[1:]], stdout=write, stderr=subprocess.PIPE,
                               text=True, timeout=120)
        finally:
            os.close(write)
        assert (p.returncode, p.stderr) == (128 + signal.SIGPIPE, ""), (argv, p.stderr)


@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_stops_the_service_with_one_line(tmp_path, workers):
    """Ctrl-C to ``shard-service serve`` (its process group: with ``--workers 2``, the parent and
    both workers): one line, status 130, the catalog sound. Before: status 0, as for SIGTERM."""
    from shards.catalog import Catalog

    catalog = str(tmp_path / "catalog.sqlite")
    serve = subprocess.Popen([os.path.join(BIN, "shard-service"), "serve", "--catalog", catalog, "--create",
                              "--port", "0", "--workers", str(workers)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert serve.stdout.readline().startswith("serving http://127.0.0.1:")
        os.killpg(serve.pid, signal.SIGINT)
        _, stderr = serve.communicate(timeout=60)
    finally:
        serve.kill()
        serve.wait()
    assert serve.returncode == 130, stderr
    assert error_line(stderr) == ("shard-service serve: error: interrupted: the server has stopped, and the "
                                  "builds it was running are recorded 'stopped' in the catalog")
    assert Catalog(catalog).list() == []


def test_a_signal_while_the_server_closes_its_loop_is_no_traceback(tmp_path):
    """A second signal at the worst moment of a stop: Ctrl-C stops ``shard-service serve``, which is
    held just after asyncio closed its loop's self-pipe (the signal wakeup fd) and before it removed
    its signal handlers (tests/helpers/holdpoint.py), and a SIGTERM arrives there, as the parent's SIGTERM
    reaches a ``--workers`` worker beside the group's Ctrl-C. Still one line and status 130. Before:
    "Exception ignored when trying to write to the signal wakeup fd: ... OSError: [Errno 9] Bad file
    descriptor" with its traceback (seen in a suite run under load)."""
    catalog = str(tmp_path / "catalog.sqlite")
    hold, held = os.pipe()
    release, go = os.pipe()
    serve = subprocess.Popen([sys.executable, HOLDPOINT,
                              "asyncio.selector_events:BaseSelectorEventLoop._close_self_pipe",
                              "-m", "service", "serve", "--catalog", catalog, "--create", "--port", "0"],
                             env={**os.environ, "HOLD_FD": str(held), "RELEASE_FD": str(release)},
                             pass_fds=(held, release), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True, preexec_fn=as_from_a_shell)
    os.close(held)
    os.close(release)
    try:
        assert serve.stdout.readline().startswith("serving http://127.0.0.1:")
        serve.send_signal(signal.SIGINT)
        with os.fdopen(hold) as f:
            assert f.readline() == "held\n"
        serve.send_signal(signal.SIGTERM)
        os.close(go)  # let it go on
        _, stderr = serve.communicate(timeout=60)
    finally:
        serve.kill()
        serve.wait()
    assert serve.returncode == 130, stderr
    assert "Exception ignored" not in stderr, stderr[-3000:]
    assert error_line(stderr) == ("shard-service serve: error: interrupted: the server has stopped, and the "
                                  "builds it was running are recorded 'stopped' in the catalog")


def trainer(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(BIN, "trainer"), "train", *argv], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.long
def test_a_node_cache_filling_its_disk_is_one_line_and_the_rerun_continues(tmp_path, disk):
    """``--cache-dir`` without a budget on a disk that holds 3 of the 8 shards. Before: 97 lines."""
    data = tmp_path / "data"
    make_shardset(str(data), {"train": 24, "val": 3}, per_shard=3, frames=4)
    largest = max(p.stat().st_size for p in data.glob("train/*.tar"))
    cache = disk(3 * largest + PAGE) / "cache"
    run = [*TRAIN, "--data", str(data), "--cache-dir", str(cache), "--output-dir", str(tmp_path / "run")]
    p = trainer(*run)
    assert p.returncode != 0
    line = error_line(p.stderr)
    assert re.search(rf"trainer train: error: {re.escape(str(cache))}/[0-9a-f]{{2}}/[0-9a-f]{{64}}\.tar: no "
                     r"space left on device: the write needs [\d,]+ bytes, [\d,]+ are free; the cache has no "
                     r"budget: give it one the disk can hold \(\$SHARD_CACHE_BUDGET", line), line
    copies = list(cache.glob("*/*.tar"))
    assert copies and not temporaries(cache) and not list(cache.glob("*/*.lock"))
    shards = {s.sha256 for split in Manifest.load(str(data)).splits.values() for s in split.shards}
    for copy in copies:  # whole and verified, or absent
        assert copy.stem in shards and hashlib.sha256(copy.read_bytes()).hexdigest() == copy.stem

    disk(16 * largest)
    p = trainer(*run, "--resume")
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(list(cache.glob("*/*.tar"))) == 9  # every shard, once


@pytest.mark.long
def test_a_full_disk_at_a_checkpoint_keeps_the_previous_one_and_the_rerun_continues_bitwise(tmp_path, disk):
    """The output directory's disk holds one checkpoint but not a second beside it (a checkpoint is
    written under a temporary name, then renamed): the step-1 checkpoint is kept whole, the step-2
    one is refused in one line; with room, ``--resume`` ends bitwise equal to an unbroken run."""
    data = tmp_path / "data"
    make_shardset(str(data), {"train": 12, "val": 3}, per_shard=3, frames=4)
    straight = trainer(*TRAIN, "--data", str(data), "--output-dir", str(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    size = (tmp_path / "straight" / "checkpoint.pt").stat().st_size

    out = disk(size * 3 // 2) / "run"
    run = [*TRAIN, "--data", str(data), "--output-dir", str(out), "--checkpoint-steps", "1"]
    p = trainer(*run)
    assert p.returncode == 1
    line = error_line(p.stderr)
    assert re.fullmatch(rf"trainer train: error: {re.escape(str(out))}/checkpoint\.pt: no space left on "
                        r"device: the write needs [\d,]+ bytes, [\d,]+ are free: this checkpoint is not "
                        r"written, the previous one is kept; "
                        "with room, the same command with --resume continues from the last one written",
                        line), line
    assert sorted(os.listdir(out)) == ["checkpoint.pt", "metrics.jsonl"]
    kept = torch.load(out / "checkpoint.pt", weights_only=True)
    assert (kept["epoch"], kept["batch"], kept["step"]) == (0, 1, 1)

    disk(size * 8)
    p = trainer(*run, "--resume")
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (tmp_path / "straight", out))
    assert a["step"] == b["step"] == 4
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key


@pytest.mark.long
def test_resume_from_a_truncated_checkpoint_is_one_line_and_touches_nothing(tmp_path):
    """Before: 36 lines ending in ``ValueError: negative seek value``."""
    data = tmp_path / "data"
    make_shardset(str(data), {"train": 6, "val": 3}, per_shard=3, frames=4)
    run = [*TRAIN, "--data", str(data), "--output-dir", str(tmp_path / "run")]
    assert trainer(*run).returncode == 0
    path = tmp_path / "run" / "checkpoint.pt"
    whole = path.read_bytes()
    for damaged, reason in ((whole[:30000], r"ValueError: negative seek value -\d+"),
                            (whole[:-1000], "RuntimeError"),
                            (b"", "EOFError"), (b"not a checkpoint\n", "UnpicklingError")):
        path.write_bytes(damaged)
        p = trainer(*run, "--resume")
        assert p.returncode == 1
        line = error_line(p.stderr)
        assert re.fullmatch(rf"trainer train: error: --resume refused: {re.escape(str(path))} "
                            rf"\({len(damaged):,} bytes\) does not load: truncated or corrupt \({reason}\); "
                            rf"the run keeps no other checkpoint: "
                            "restore it from a copy, or start afresh with --overwrite", line), line
        assert (path.read_bytes() == damaged
                and sorted(os.listdir(path.parent)) == ["checkpoint.pt", "metrics.jsonl"])


@pytest.mark.long
def test_ctrl_c_under_horovodrun_stops_every_rank_with_its_checkpoint(tmp_path):
    """Ctrl-C in horovodrun's terminal (SIGINT to its process group, as rank 0's 2nd step starts).
    The ranks are not in that group (Horovod's helpers start sessions of their own): horovodrun
    sends each rank SIGTERM, and SIGKILL 5 s later to what is left. Every rank stops after the same
    step, rank 0 saves it, each prints its one line, none a traceback, and ``--resume`` continues
    from that step. horovodrun itself then reports each rank's status and raises its own
    RuntimeError (horovod/runner/gloo_run.py ``launch_gloo``, uncaught by ``horovodrun``): its
    traceback and status 1 are Horovod's (docs/faults.md)."""
    data, out = tmp_path / "data", tmp_path / "run"
    make_shardset(str(data), {"train": 24, "val": 3}, per_shard=3, frames=4)
    # (Horovod's backend)
    flags = [*TRAIN[2:], "--data", str(data), "--output-dir", str(out), "--batch-size", "2"]
    job = subprocess.run([os.path.join(BIN, "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
                          sys.executable,
                          str(Path(__file__).with_name("helpers") / "faultrun.py"), "train", *flags],
                         env={**os.environ, "OMP_NUM_THREADS": "1", "FAULT": "step:2:INT:terminal",
                              "EXIT_LOG": str(tmp_path / "exits")},
                         capture_output=True, text=True, timeout=300, start_new_session=True)
    ranks = {r: [line.split(":", 1)[1] for line in (job.stdout + job.stderr).splitlines()
                 if line.startswith(f"[{r}]<")]
             for r in (0, 1)}
    for r in (0, 1):
        assert (tmp_path / f"exits.rank{r}.jsonl").read_text() == '{"exit": 143}\n', job.stderr[-3000:]
        assert not [line for line in ranks[r] if "Traceback" in line], ranks[r]
    assert any("stopped by signal 15 in epoch 1 after batch 2 (step 2" in line for line in ranks[0]), ranks[0]
    # horovodrun's report: 143, or 137 for a rank still tearing down when its 5 s were up (under load)
    assert (job.returncode == 1 and re.search(r"Process [01] exit with status code 1(43|37)\.",
                                              job.stdout)), job.stdout
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    assert (saved["epoch"], saved["batch"], saved["step"]) == (0, 2, 2)

    resumed = trainer(*flags, "--backend", "none", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "in epoch 1, after batch 2 (step 2" in resumed.stderr
