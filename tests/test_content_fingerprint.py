"""``ingest build --fingerprint content``: inputs identified by their bytes, hashed by the Ray
workers, digests cached by path, size, mtime, ctime and inode. Real ffmpeg videos, real Ray, a
real catalog; which files the build reads is observed with inotify, from every process."""
from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path

import pytest
from helpers import media

from ingest import registry
from ingest.build import build
from ingest.clips import ClipConfig

pytestmark = pytest.mark.usefixtures("ray_local")
CFG = ClipConfig(frames=4, short_side=32)
OPTS = dict(splits=("train",), shard_samples=4, workers=2, videos_per_task=2)
IN_OPEN = 0x20


def padded(data: bytes, size: int) -> bytes:
    """An mp4 grown to ``size`` bytes by a trailing ``free`` box (which players skip)."""
    return data + struct.pack(">I", size - len(data)) + b"free" + bytes(size - len(data) - 8)


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """Two train videos per class, all of one size, and a corrected version of the first (other
    pixels, the same size)."""
    raw = tmp_path_factory.mktemp("raw")
    made = {name: media.make_video(raw / f"{name}.mp4", frames=12, width=48, height=32,
                                   texture=texture).read_bytes()
            for name, texture in (("jump0", False), ("jump1", True), ("walk0", True), ("walk1", False))}
    made["corrected"] = media.make_video(raw / "corrected.mp4", frames=13, width=48, height=32).read_bytes()
    size = max(map(len, made.values())) + 16
    return {name: padded(data, size) for name, data in made.items()}


def tree(root: Path, videos: dict[str, bytes]) -> Path:
    for name in ("jump0", "jump1", "walk0", "walk1"):
        path = root / "train" / name[:-1] / f"{name}.mp4"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(videos[name])
    return root


def correct_keeping_mtime(video: Path, data: bytes) -> None:
    """Rewrite ``video`` in place and put its mtime back, as ``cp -p`` does: same size, inode, mtime."""
    before = video.stat()
    with open(video, "r+b") as f:
        f.write(data)
    os.utime(video, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = video.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns,
                                                                before.st_ino)


class Opens:
    """Counts opens of the files in some directories, by any process (inotify ``IN_OPEN``)."""

    def __init__(self, dirs):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        for d in dirs:
            assert self.libc.inotify_add_watch(self.fd, str(d).encode(), IN_OPEN) >= 0

    def take(self) -> list[str]:
        """Names of the files opened since the last call, one entry per open."""
        names = []
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return names
            pos = 0
            while pos < len(data):
                _, mask, _, length = struct.unpack_from("iIII", data, pos)
                name = data[pos + 16:pos + 16 + length].rstrip(b"\0").decode()
                if name and not mask & 0x40000000:  # IN_ISDIR: the listing opening a folder
                    names.append(name)
                pos += 16 + length

    def close(self):
        os.close(self.fd)


def test_a_corrected_video_with_its_mtime_kept_is_a_stale_reuse_under_stat_and_a_new_build_under_content(
        videos, tmp_path):
    src = tree(tmp_path / "videos", videos)
    catalog, cache = str(tmp_path / "catalog.sqlite"), str(tmp_path / "digests.sqlite")
    _, stat_set = registry.build(catalog, str(src), str(tmp_path / "stat1"), CFG, **OPTS)
    _, content_set = registry.build(catalog, str(src), str(tmp_path / "content1"), CFG, fingerprint="content",
                                    hash_cache=cache, **OPTS)
    assert content_set.id != stat_set.id and content_set.options["fingerprint"] == "content"
    assert "fingerprint" not in stat_set.options  # stat ids are those of sets built before the option

    correct_keeping_mtime(src / "train" / "jump" / "jump0.mp4", videos["corrected"])
    summary, again = registry.build(catalog, str(src), str(tmp_path / "stat2"), CFG, **OPTS)
    assert summary.reused and again.id == stat_set.id  # the stale set, as --fingerprint stat documents
    summary, again = registry.build(catalog, str(src), str(tmp_path / "content2"), CFG, fingerprint="content",
                                    hash_cache=cache, **OPTS)
    assert not summary.reused and again.id != content_set.id
    assert again.location == str(tmp_path / "content2") and again.state == "ready"
    old, new = (Path(loc, "manifest.json").read_bytes() for loc in (content_set.location, again.location))
    assert old != new


def test_the_same_videos_under_another_path_reuse_the_set_and_a_rebuild_reads_no_input(videos, tmp_path):
    first, second = tree(tmp_path / "a", videos), tree(tmp_path / "b", videos)
    catalog, cache = str(tmp_path / "catalog.sqlite"), str(tmp_path / "digests.sqlite")
    class_dirs = [d for root in (first, second) for d in (root / "train").iterdir()]
    opens = Opens(class_dirs)
    try:
        _, built = registry.build(catalog, str(first), str(tmp_path / "out1"), CFG, fingerprint="content",
                                  hash_cache=cache, **OPTS)
        assert set(opens.take()) == {p.name for p in first.glob("train/*/*.mp4")}  # hashed and decoded

        summary, found = registry.build(catalog, str(second), str(tmp_path / "out2"), CFG,
                                        fingerprint="content", hash_cache=cache, **OPTS)
        assert summary.reused and found.id == built.id and found.location == built.location
        assert not (tmp_path / "out2").exists()  # nothing staged, nothing decoded
        # hashed once each
        assert sorted(opens.take()) == sorted(p.name for p in second.glob("train/*/*.mp4"))

        summary, found = registry.build(catalog, str(first), str(tmp_path / "out3"), CFG,
                                        fingerprint="content", hash_cache=cache, **OPTS)
        assert summary.reused and found.id == built.id
        assert opens.take() == []  # every digest came from the cache: no input opened
        assert registry.plan(str(second), CFG, fingerprint="content",
                             hash_cache=str(tmp_path / "fresh.sqlite"),
                             **{k: OPTS[k] for k in ("splits", "shard_samples")}).id == built.id
        assert len(opens.take()) == 4  # without the cache, every input is read again
    finally:
        opens.close()
    stat_ids = {registry.plan(str(root), CFG, splits=("train",), shard_samples=4).id
                for root in (first, second)}
    assert len(stat_ids) == 2  # by stat, the same videos under another path are other inputs


def test_without_a_catalog_a_finished_out_is_kept_under_stat_and_rebuilt_under_content(videos, tmp_path):
    src = tree(tmp_path / "videos", videos)
    cache = str(tmp_path / "digests.sqlite")

    def run(kind):
        return build(str(src), str(tmp_path / kind), CFG, fingerprint=kind, hash_cache=cache, **OPTS)

    first = {kind: run(kind) for kind in ("stat", "content")}
    assert not any(s.reused for s in first.values())
    correct_keeping_mtime(src / "train" / "walk" / "walk1.mp4", videos["corrected"])
    assert run("stat").reused
    assert not run("content").reused
