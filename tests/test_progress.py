"""Progress output (``shards.base.progress``) where it goes: lines with rate and ETA in a log, a live bar
on a real terminal (a pseudo-terminal read back through a small screen model), and log messages,
from this process or a forked one, never on the bar's line. Also the console scripts' wording:
help paragraphs, plurals. The trainer's progress lines: ``test_resume.py``; ingest's: here."""
from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

from shards.base.progress import Progress, console_handler


class Clock:
    """A clock the test moves: the lines' timing without sleeping."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_not_on_a_terminal_a_line_every_interval_with_rate_and_eta_and_one_at_the_end():
    out, clock = io.StringIO(), Clock()
    bar = Progress(10, desc="decode", unit="video", stream=out, every=30, clock=clock)
    for _ in range(9):
        clock.now += 10  # a video every 10 s: a line every third video
        bar.update(1, failed=0)
    clock.now += 10
    bar.update(1, failed=1)
    bar.close()
    assert out.getvalue().splitlines() == [
        "decode: 3/10 videos (30%), 0.1 videos/s, ETA 0:01:10; failed 0",
        "decode: 6/10 videos (60%), 0.1 videos/s, ETA 0:00:40; failed 0",
        "decode: 9/10 videos (90%), 0.1 videos/s, ETA 0:00:10; failed 0",
        "decode: 10/10 videos in 0:01:40, 0.1 videos/s; failed 1",
    ]
    assert "\r" not in out.getvalue()


def test_a_loop_stopped_early_says_where_it_stopped_and_resumed_work_is_not_counted_in_the_rate():
    out, clock = io.StringIO(), Clock()
    with Progress(100, desc="pack train", unit="shard", initial=40, stream=out, clock=clock) as bar:
        clock.now += 20
        bar.update(10)
    assert out.getvalue() == "pack train: stopped at 50/100 after 0:00:20, 0.5 shards/s\n"
    quiet = io.StringIO()
    with Progress(5, desc="epoch 1/2", unit="step", stream=quiet, enabled=False, every=0) as bar:
        bar.update(5)
    assert quiet.getvalue() == ""  # ranks other than 0


def screen(raw: str) -> list[str]:
    """The lines a terminal shows after ``raw``: carriage return, newline, erase to the end of the
    line (ESC [ K) and cursor up (ESC [ A) applied; other escapes (colours) dropped."""
    lines, row, col = [""], 0, 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\r|\n|[^\x1b\r\n]+", raw):
        if token == "\r":
            col = 0
        elif token == "\n":
            row, col = row + 1, 0
            lines += [""] * (row + 1 - len(lines))
        elif token.endswith("K"):
            lines[row] = lines[row][:col]
        elif token.endswith("A"):
            row = max(0, row - int(token[2:-1] or 1))
        elif not token.startswith("\x1b"):
            line = lines[row].ljust(col)
            lines[row] = line[:col] + token + line[col + len(token):]
            col += len(token)
    return lines


def on_a_terminal(work) -> str:
    """What ``work(stream)`` writes to a real pseudo-terminal, read from its other end."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 rows of 100 columns
    stream = os.fdopen(slave, "w", buffering=1)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: [chunks.append(c) for c in iter(lambda: _read(master), b"")])
    reader.start()
    try:
        assert stream.isatty()
        work(stream)
    finally:
        stream.close()
        reader.join(timeout=30)
        os.close(master)
    return b"".join(chunks).decode()


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # the terminal's other end closed
        return b""


def test_on_a_terminal_a_live_bar_and_messages_on_lines_of_their_own(tmp_path):
    """Before: a message logged while the bar was drawn (the loader's cache refusal) was printed onto
    the bar's line. Here one from this process and one from a forked process, as a loader worker is."""
    log = logging.getLogger("test_progress")
    log.propagate = False

    def work(stream):
        handler = console_handler(stream)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        log.addHandler(handler)
        try:
            bar = Progress(4, desc="epoch 1/1", unit="step", stream=stream, leave=True)
            bar.update(1, loss="0.693")
            bar.bar.refresh()
            log.warning("the cache budget is held by shards in use; waiting")
            bar.update(1)
            bar.bar.refresh()
            pid = os.fork()
            if pid == 0:  # a loader worker: its own copy of the bar, never drawn from here
                try:
                    log.warning("worker: a message from another process")
                finally:
                    os._exit(0)
            assert os.waitpid(pid, 0)[1] == 0
            bar.update(2)
            bar.close()
        finally:
            log.removeHandler(handler)

    raw = on_a_terminal(work)
    assert "\r" in raw  # redrawn in place, not a line per refresh
    lines = [line.rstrip() for line in screen(raw) if line.strip()]
    assert "test_progress: the cache budget is held by shards in use; waiting" in lines, lines
    assert "test_progress: worker: a message from another process" in lines, lines
    bars = [line for line in lines if line.startswith("epoch 1/1")]
    assert bars and all("test_progress" not in line for line in bars), lines
    assert re.match(r"epoch 1/1: 100%.*4/4", bars[-1]), lines  # the bar, left at its end
    assert len(lines) == 3, lines  # two messages and the bar: no stale bars above them


# --- the console scripts' output -------------------------------------------------------------------
def command(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300, **kw)


def test_ingest_synth_progress_in_a_log_and_its_wording(tmp_path):
    done = command("ingest", "synth", "--out", str(tmp_path / "src"), "--classes", "1",
                   "--train-per-class", "2", "--val-per-class", "0", "--width", "32", "--height", "32",
                   "--fps", "5", "--seconds", "0.6", "--workers", "1",
                   env={**os.environ, "KF_PROGRESS_SECONDS": "0"})
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr
    assert re.search(r"^synth: 1/2 videos \(50%\), [\d.]+ videos/s, ETA \d:\d\d:\d\d$", done.stderr,
                     re.M), done.stderr
    assert re.search(r"^synth: 2/2 videos in \d:\d\d:\d\d, [\d.]+ videos/s$", done.stderr, re.M), done.stderr
    assert "1 class," in done.stdout and "1 classes" not in done.stdout  # before: "1 classes"


@pytest.mark.parametrize("argv, says, never", [
    (["ingest", "synth", "--help"],
     ["frame width (default: the --preset's)", "encoder processes (default: one per CPU)"], ["None:"]),
    (["shards", "preview", "--help"], ["Examples:\n\n    shards preview shards/k400 --split val",
                                       "--out sheet.png\n\n    shards preview http://"], []),
])
def test_help_says_defaults_in_words_and_keeps_examples_apart(argv, says, never):
    """Before: "None: the preset's"; ``shards preview --help`` ran its two example commands
    into one filled paragraph with the text around them."""
    done = command(*argv, env={**os.environ, "COLUMNS": "100"})
    text = re.sub(r"\s*\n\s*", " ", done.stdout)  # argparse wraps the option help
    for words in says:
        assert words in done.stdout or words in text, done.stdout
    for words in never:
        assert words not in done.stdout


def test_counts_of_one_are_singular(tmp_path):
    """Before: "1 shards checked", "train: 1 clips in 1 shards"."""
    from helpers.shardsets import corrupt_sample, make_shardset

    make_shardset(str(tmp_path / "set"), {"train": 1}, per_shard=1)
    corrupt_sample(tmp_path / "set", sample=0, at=600)
    verify = command("shards", "verify", str(tmp_path / "set"))
    assert (verify.returncode == 1
            and verify.stdout.splitlines()[-1] == "1 shard checked: 2 problems"), verify.stdout
    # its one clip damaged: no figures
    stats = command("shards", "stats", str(tmp_path / "set"), "--probe", "0")
    assert stats.returncode == 1 and "Traceback" not in stats.stderr, stats.stderr
    assert "train: 1 clip in 1 shard," in stats.stdout, stats.stdout


def test_the_demos_live_line_the_epoch_line_and_trainer_plots_table_round_alike(tmp_path):
    """The same record shows the same digits everywhere: the demo's live line (its ``status`` shell
    function, taken from scripts/demo.sh and run by bash), the trainer's epoch log line
    (``metrics.figure``) and ``trainer plot``'s tables. 11/16 = 68.75% read 68.7% live and 68.8 in
    the table before (the live line cut digits off, the table rounded)."""
    from trainer import metrics, plot

    values = [100 * 11 / 16, 100 * 2 / 3, 100 * 7 / 64, 100 * 1 / 3, 100.0, 25.0]
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for epoch, v in enumerate(values, 1):
            f.write(json.dumps({"event": "epoch", "step": epoch, "epoch": epoch, "val_top1": v,
                                "train_loss": 1.0, "data_time": 0.01, "compute_time": 0.02,
                                "clips_per_s": 10.0}) + "\n")
    demo = (Path(__file__).resolve().parents[1] / "scripts" / "demo.sh").read_text()
    status = re.search(r"^status\(\) \{.*?^\}$", demo, re.M | re.S).group(0)
    table = plot.tables([str(run)], ["run"], max_rows=len(values)).splitlines()
    by_epoch = {int(line.split("|")[0]): line.split("|")[1].strip() for line in table[2:2 + len(values)]}
    lines = (metrics.figure("val_top1", v) for v in values)
    for epoch, (v, logged) in enumerate(zip(values, lines), 1):
        with open(run / "metrics.jsonl", "w") as f:  # the live line reads the file's last epoch record
            f.write(json.dumps({"event": "epoch", "epoch": epoch, "val_top1": v}) + "\n")
        live = subprocess.run(["bash", "-c", f'{status}\nout={tmp_path}; status run'], capture_output=True,
                              text=True, check=True).stdout.strip()
        assert live == f"epoch {epoch}, val top-1 {by_epoch[epoch]}%" and logged == by_epoch[epoch], (live, v)
    assert by_epoch[1] == "68.8" and by_epoch[2] == "66.7"
