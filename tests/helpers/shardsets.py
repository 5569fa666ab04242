"""Test helpers: small synthetic shard sets (PIL-made JPEG frames, no ffmpeg), an HTTP server with
byte-range support on 127.0.0.1, and the shard service in a subprocess with a plain-socket client."""
from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer  # not `import http`: http() below

import numpy as np
from PIL import Image

from shards.format import motionfield
from shards.format.manifest import Manifest, SplitInfo, digest
from shards.format.packing import shard_name, write_shard
from shards.format.tar import sample_bytes


def frame_colour(sample: int, frame: int) -> tuple[int, int, int]:
    """The solid colour of a test frame: identifies sample and frame after JPEG decoding."""
    return (sample * 37) % 256, frame * 30, 128


def jpeg(colour, size=(64, 48)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def uniform_field(u: float, v: float, size=(64, 48)) -> bytes:
    """A ``shards.format.motionfield`` PNG of a frame of ``size`` whose every cell moved by (u, v)."""
    cols, rows = motionfield.grid_size(*size)
    return motionfield.encode(np.dstack([np.full((rows, cols), u), np.full((rows, cols), v)]),
                              np.ones((rows, cols), dtype=bool))


def frame_motion(sample: int, frame: int) -> tuple[float, float]:
    """The uniform motion of a test frame's field: rightward, growing with the frame; v from the sample."""
    return 2.0 + frame, float(sample % 5)


def clip_samples(split: str, count: int, num_classes: int, frames: int, size, labeled: bool,
                 motion: str | None, class_sorted: bool = False):
    """(key, label, sample_bytes) for ``count`` clips, two clips per video; with ``motion`` (a kind
    of ``shards.format.motionfield``) a uniform field of ``frame_motion`` beside each frame. Labels go
    round the classes (i % num_classes), or with ``class_sorted`` class by class."""
    for i in range(count):
        key = f"{split}_v{i // 2:04d}_c{i % 2:02d}"
        label = (i * num_classes // count if class_sorted else i % num_classes) if labeled else -1
        members = [(f"{t:02d}.jpg", jpeg(frame_colour(i, t), size)) for t in range(frames)]
        if motion:
            members += [(motionfield.member(t, motion), uniform_field(*frame_motion(i, t), size))
                        for t in range(frames)]
        if labeled:
            members.append(("cls", str(label).encode()))
        meta = {"source": f"videos/{key[:-4]}.mp4", "label": label, "clip": i % 2,
                "frame_indices": list(range(0, 8 * frames, 8)), "fps": 25.0, "frame_count": 8 * frames,
                "width": size[0], "height": size[1]}
        members.append(("json", json.dumps(meta).encode()))
        yield key, label, sample_bytes(key, members)


def make_shardset(directory: str, splits: dict[str, int], per_shard: int = 5, num_classes: int = 3,
                  frames: int = 8, size=(64, 48), unlabeled=("test",), classes: list[str] | None = None,
                  motion: str | None = None, class_sorted: bool = False) -> Manifest:
    """Write ``splits`` ({name: clip count}) as shards of ``per_shard`` clips plus a manifest.

    Clip i of a split has label i % num_classes (with ``class_sorted``: i * num_classes // count,
    the set written class by class) and frame t coloured ``frame_colour(i, t)``.
    ``classes``: the class names (default ``class0``, ``class1``, ...; their number overrides num_classes).
    ``motion``: also a motion field of that kind per frame (``frame_motion``), as ``ingest build --motion``.
    """
    num_classes = len(classes) if classes else num_classes
    out = {}
    for split, count in splits.items():
        samples = list(clip_samples(split, count, num_classes, frames, size, split not in unlabeled, motion,
                                    class_sorted))
        shards = []
        for k, start in enumerate(range(0, count, per_shard)):
            name = shard_name(split, k)
            shards.append(write_shard(os.path.join(directory, name), name, samples[start:start + per_shard]))
        out[split] = SplitInfo(shards=shards)
    classes = classes or [f"class{c}" for c in range(num_classes)]
    m = Manifest(classes=classes, splits=out, config={"clip": {"frames": frames,
                                                               **({"motion": motion} if motion else {})}},
                 fingerprint=digest({"splits": splits, "per_shard": per_shard}))
    m.save(directory)
    with open(os.path.join(directory, "classes.txt"), "w") as f:
        f.write("".join(c + "\n" for c in classes))
    return m


def make_class_set(directory: str, counts: list[int], classes: list[str]) -> Manifest:
    """A one-shard train split with ``counts[c]`` clips of class c, each one 16x16 frame: a class
    chart's data (hundreds of classes in a fraction of a second)."""
    frame = jpeg((90, 120, 200), (16, 16))
    labels = [c for c, n in enumerate(counts) for _ in range(n)]
    samples = [(f"v{i:05d}", c, sample_bytes(f"v{i:05d}", [("00.jpg", frame), ("cls", str(c).encode())]))
               for i, c in enumerate(labels)]
    name = shard_name("train", 0)
    m = Manifest(classes=classes,
                 splits={"train": SplitInfo(shards=[write_shard(os.path.join(directory, name), name,
                                                                                 samples)])},
                 config={"clip": {"frames": 1}}, fingerprint=digest({"counts": counts}))
    m.save(directory)
    return m


def corrupt_sample(directory, split: str = "train", shard: int = 0, sample: int = 2, at: int = 3000,
                   nbytes: int = 1, mask: int = 0x10, keep_mtime: bool = True):
    """Flip ``nbytes`` bytes (XOR ``mask``) ``at`` bytes into sample ``sample`` of shard ``shard`` of
    ``split``, in place (same size); with ``keep_mtime`` as bit rot would (the modification time
    unchanged). Returns the shard's ``ShardInfo`` (its ``keys[sample]`` is the damaged sample's)."""
    info = Manifest.load(str(directory)).splits[split].shards[shard]
    path = os.path.join(str(directory), info.name)
    st = os.stat(path)
    start = info.offsets[sample] + at
    assert at + nbytes <= info.lengths[sample], "the bytes to flip must lie inside the sample"
    with open(path, "r+b") as f:
        f.seek(start)
        data = f.read(nbytes)
        f.seek(start)
        f.write(bytes(b ^ mask for b in data))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return info


class RangeHandler(SimpleHTTPRequestHandler):
    """Static files with single byte-range support (``Range: bytes=a-b``); records (method, path)."""

    def send_head(self):
        rng = self.headers.get("Range")
        path = self.translate_path(self.path)
        self.server.requests.append((self.command, self.path))
        if not rng or os.path.isdir(path):
            return super().send_head()
        try:
            f = open(path, "rb")
        except OSError:
            self.send_error(404)
            return None
        size = os.fstat(f.fileno()).st_size
        a, b = rng.split("=", 1)[1].split("-")
        start, end = int(a), min(int(b) if b else size - 1, size - 1)
        if getattr(self.server, "gate", None):  # servers made without serve() have none
            self.server.gate(self.path, start, end + 1)  # may hold the answer
        f.seek(start)
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        return io.BytesIO(f.read(end - start + 1))

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve(directory: str, gate=None):
    """Serve ``directory`` over HTTP on 127.0.0.1; yields (base URL, list of (method, path) requested).
    ``gate(path, start, end)`` is called with every byte range asked for before it is answered (it
    may hold the answer)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(RangeHandler, directory=directory))
    server.daemon_threads = True
    server.requests, server.gate = [], gate
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.requests
    finally:
        server.shutdown()
        server.server_close()


def register(catalog, directory: str, name: str, dataset_id: str | None = None):
    """Record an existing shard set as ready in a catalog (as a finished build would); returns the record."""
    from ingest.registry import describe_set
    from shards.tools.verify import set_file_stamps, stamps

    dataset_id = dataset_id or digest(directory) * 4
    claim = catalog.claim(dataset_id, source="tests", location=directory,
                          options={"splits": ["train", "val"]},
                          name=name, strict_name=True)
    splits, files, sha = describe_set(directory)
    catalog.finish(dataset_id, claim.owner, splits=splits, files=files, manifest_sha256=sha,
                   builder_version="tests",
                   verified_files={**stamps(Manifest.load(directory)), **set_file_stamps(directory, files)})
    return catalog.get(dataset_id)


def served_tiny(root, token: str):
    """``root/tiny`` (10 clips in shards of 5) registered as ``tiny`` in ``root/catalog.sqlite``, and
    ``root/tokens`` holding ``token``: what a service test serves; ``root`` returned."""
    from shards.catalog import Catalog

    make_shardset(str(root / "tiny"), {"train": 10}, per_shard=5)
    register(Catalog(str(root / "catalog.sqlite")), str(root / "tiny"), "tiny")
    (root / "tokens").write_text(token + "\n")
    return root


class ServiceProcess:
    """``shard-service serve`` in a subprocess on 127.0.0.1, on a free port; ``command``: how it is
    started, without ``args``."""

    def __init__(self, *args: str, env: dict | None = None, command: tuple[str, ...] | None = None):
        import sys

        self.args, self.env, self.proc, self.url = args, env, None, None
        self.command = command or (sys.executable, "-m", "service", "serve", "--port", "0")

    def start(self) -> str:
        import subprocess

        self.proc = subprocess.Popen([*self.command, *self.args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env)
        seen = []
        while not (line := self.proc.stdout.readline()).startswith("serving "):
            seen.append(line)
            assert line, "the server exited: " + "".join(seen)
        self.url = line.split()[1].rstrip("/")  # the viewer's URL, the API's without its /v1
        self.banner = [line, self.proc.stdout.readline()]  # the start lines: the viewer's URL, the API's
        self.log = seen
        # keep draining
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()
        return self.url

    def kill(self, signum: int = 9) -> None:
        """Signal the server and wait for it to end; nothing if it was never started (a fixture's
        clean-up after an earlier start failed)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        self.proc.wait(timeout=60)

    def build_process(self, nth: int = 0, dataset: str = ""):
        """The ``nth`` build process this server started (of ``dataset``'s builds, if given; a
        psutil.Process), once its log says so."""
        import psutil

        deadline = time.time() + 60
        while len(started := [line for line in self.log if f"{dataset}: build process" in line
                              and "started" in line]) <= nth:
            assert time.time() < deadline and self.proc.poll() is None, "".join(self.log)
            time.sleep(0.05)
        return psutil.Process(int(started[nth].split("build process ")[1].split()[0]))


def http(url: str, method: str = "GET", path: str = "/", headers: dict | None = None, body: bytes = b"",
         raw_path: bytes | None = None) -> tuple[int, dict, bytes]:
    """One request over a plain socket, the path sent byte for byte as given."""
    host, port = url.split("//")[1].split(":")
    lines = [b"%s %s HTTP/1.1" % (method.encode(), raw_path if raw_path is not None else path.encode()),
             f"Host: {host}:{port}".encode(), b"Connection: close", b"Content-Length: %d" % len(body)]
    lines += [f"{k}: {v}".encode() for k, v in (headers or {}).items()]
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    got = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
    return int(status_line.split()[1]), got, payload


def wait_for(url, dataset, states, timeout=240, headers: dict | None = None):
    """Polls the build's state until it is one of ``states``, as a client polling through a gateway
    does: a 502, 503 or 504 is asked again (nginx answers 502 while it holds every replica failed,
    for up to their ``fail_timeout``), any other answer that is not the state fails the test.
    ``headers``: sent with each request (a token, under ``--read-auth``)."""
    deadline, answer = time.time() + timeout, None
    while time.time() < deadline:
        status, _, body = http(url, path=f"/v1/builds/{dataset}", headers=headers)
        if status in (502, 503, 504):
            answer = f"{status}: {body[:200]!r}"
        else:
            assert status == 200, f"build {dataset}: {status}: {body[:500]!r}"
            answer = json.loads(body)
            if answer["state"] in states:
                return answer
        time.sleep(0.2)
    raise AssertionError(f"build {dataset} not {states} in {timeout} s; last answer: {answer}")


def clip_loader(data, split: str = "train", **options):
    """A test's shorthand: ``ClipLoader(data, split, EpochOptions(...), ...)`` from keywords, the
    planner's (``EpochOptions``' fields) gathered into its options object."""
    from dataclasses import fields

    from trainer.data import ClipLoader, EpochOptions

    planning = {f.name: options.pop(f.name) for f in fields(EpochOptions) if f.name in options}
    return ClipLoader(data, split, EpochOptions(**planning), **options)
