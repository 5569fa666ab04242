"""Hanging inputs: everything done for one video runs under its --timeout; the build goes on."""
from __future__ import annotations

import contextlib
import http.server
import json
import os
import select
import threading
import time
from functools import partial

import psutil
import pytest
from helpers import media
from helpers.shardsets import RangeHandler
from test_ingest import samples

from ingest.build import build
from ingest.clips import ClipConfig, make_clips
from ingest.decode.video import DecodeError
from ingest.sources import Video

CFG = ClipConfig(short_side=32)


class TrickleHandler(RangeHandler):
    """Serves files like ``RangeHandler``, but the body of any name containing ``slow`` one byte
    every 0.1 s, as a stalling CDN or a throttled link does."""

    def copyfile(self, source, outputfile):
        if "slow" not in self.path:
            return super().copyfile(source, outputfile)
        while not self.server.stopping.is_set() and (byte := source.read(1)):
            outputfile.write(byte)
            outputfile.flush()
            time.sleep(0.1)


@contextlib.contextmanager
def serve_trickling(directory):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             partial(TrickleHandler, directory=str(directory)))
    server.requests, server.stopping = [], threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.stopping.set()
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("runner", ["ray", "local"])
def test_a_trickling_download_is_cut_at_the_timeout_and_the_build_goes_on(tmp_path, request, runner):
    """In a Ray task, and in a local worker process of a build without Ray (``ingest.tasks.runtime``),
    where the deadline's SIGALRM must reach the task as in Ray's workers."""
    if runner == "ray":
        request.getfixturevalue("ray_local")
    src, out = tmp_path / "src", tmp_path / "out"
    media.make_video(src / "val" / "a" / "fast.mp4")
    media.make_video(src / "val" / "a" / "slow.mp4")
    with serve_trickling(src) as url:
        summary = build(url, str(out), CFG, workers=2, shard_samples=10, videos_per_task=1, timeout=5,
                        runner=runner)
    if runner == "local":
        assert set(summary.tasks_per_node) == {"local"}
    else:
        assert "local" not in summary.tasks_per_node
    ledger = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert ledger == [{"path": "val/a/slow.mp4", "split": "val",
                       "reason": "timed out after 5 s (downloading)", "ffmpeg": ""}]
    assert sorted(samples(out, "val")) == ["fast_c00"] and summary.failed == 1


@pytest.fixture
def stalled_pipe(tmp_path):
    """A FIFO named like a video whose writer sends each reader the first 3 kB of a real video,
    then nothing, holding the pipe open until the reader leaves: the reader blocks."""
    head = media.make_video(tmp_path / "real.mp4", frames=30).read_bytes()[:3000]
    path = media.make_named_pipe(tmp_path / "pipe.mp4")
    stop = threading.Event()

    def writer():
        while not stop.is_set():
            fd = os.open(path, os.O_WRONLY)  # waits for a reader
            try:
                os.write(fd, head)
                poll = select.poll()
                poll.register(fd, select.POLLERR)  # the reader closed its end
                while not stop.is_set() and not poll.poll(50):
                    pass
            except BrokenPipeError:
                pass
            finally:
                os.close(fd)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    yield path
    stop.set()
    os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))  # releases a writer waiting for a reader
    thread.join(5)


@pytest.mark.parametrize("decoder", ["pyav", "ffmpeg"])
def test_a_stalled_pipe_is_cut_at_the_timeout(stalled_pipe, decoder):
    # Listed as a regular file, then replaced by a pipe before a worker opens it: the listing's
    # check cannot help, the deadline must.
    video = Video("val", "val/a/pipe.mp4", str(stalled_pipe), "a", "pipe", 3000, "file")
    with pytest.raises(DecodeError, match=r"^timed out after 1 s \((probing|reading packets|decoding)\)$"):
        make_clips(video, 0, ClipConfig(short_side=32, decoder=decoder), timeout=1)
    left = [p.name() for p in psutil.Process().children(recursive=True) if p.name() in ("ffmpeg", "ffprobe")]
    assert left == []  # killed, not left behind
