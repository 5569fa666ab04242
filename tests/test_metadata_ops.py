"""Metadata operations of a whole job, counted for real in the rank and in its loader workers:
``strace -f`` over a job (``metadata_probe.py``: 3 ranks in turn, 2 forked workers each) reading
local shards, over HTTP from the dataset service (``shard-service serve --access-log``) and
through the node-local cache, against what the layout promises (``shards.plan.layout``, README):
the manifest read once per job with one open (one GET), each rank opening each shard its range
touches once and its workers sharing the descriptors, over HTTP one GET per shard a worker's
chunk touches, each shard downloaded once per node into the cache, and never a stat or a listing.
The same trace holds frame folders read the TSM way, against the planner's model of them.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from collections import Counter

import pytest
from helpers import syscalls
from helpers.shardsets import ServiceProcess, jpeg, make_shardset, register

from shards.catalog import Catalog
from shards.plan import layout

WORLD, WORKERS, BATCH = 3, 2, 2
CLIPS, PER_SHARD = 25, 5
FOLDERS, FRAMES = 3, 20  # frame-folder clips, frames extracted per video
PROBE = os.path.join(os.path.dirname(__file__), "helpers", "metadata_probe.py")
_REQUEST = re.compile(r'"(\w+) (\S+) HTTP/[\d.]+" (\d+)')


def requests_by_phase(log: list[str]) -> dict[str, list[tuple[str, str, int]]]:
    """The service's access log as (method, path, status) per phase, cut at the probe's marks."""
    phases, phase = {}, ""
    for line in log:
        m = _REQUEST.search(line)
        if not m:
            continue
        method, path, status = m[1], m[2], int(m[3])
        if path.startswith("/v1/health?mark="):
            phase = path.split("=", 1)[1]
            phases[phase] = []
        elif phase:
            phases[phase].append((method, path, status))
    return phases


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("metadata")
    shards, cache = root / "set", root / "cache"
    manifest = make_shardset(str(shards), {"train": CLIPS}, per_shard=PER_SHARD)
    register(Catalog(str(root / "catalog.sqlite")), str(shards), "probe")
    frames, rows = root / "frames", []
    for v in range(FOLDERS):  # TSM's layout: one folder per video, img_00001.jpg ...
        (frames / f"v{v}").mkdir(parents=True)
        for i in range(FRAMES):
            (frames / f"v{v}" / f"img_{i + 1:05d}.jpg").write_bytes(jpeg((v * 40, i * 10, 0)))
        rows.append({"folder": str(frames / f"v{v}"), "frames": FRAMES, "label": v})
    (frames / "rows.json").write_text(json.dumps(rows))
    server = ServiceProcess("--catalog", str(root / "catalog.sqlite"), "--access-log")
    url = server.start()
    try:
        done, trace = syscalls.trace([sys.executable, PROBE, str(shards), f"{url}/v1/datasets/probe",
                                      str(cache), str(frames), str(WORLD), str(WORKERS), str(BATCH)],
                                     str(root / "strace.txt"), timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        deadline = time.monotonic() + 30
        while not any("mark=end" in line for line in server.log) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        server.kill(15)
    split = manifest.splits["train"]
    sizes = [s.num_samples for s in split.shards]
    plan = layout.plan(layout.Totals(CLIPS, split.num_bytes / CLIPS), WORLD, WORKERS, BATCH, [WORLD],
                       num_shards=len(sizes))
    assert [r["world_size"] for r in plan["rows"]] == [WORLD]
    per_rank, per_worker = layout.shard_opens(sizes, WORLD, WORKERS, BATCH)
    return {"trace": trace, "requests": requests_by_phase(server.log), "out": done.stdout,
            "shards": str(shards), "cache": str(cache), "frames": str(frames),
            "names": [s.name for s in split.shards], "sha256": {s.sha256: s.name for s in split.shards},
            "row": plan["rows"][0]["shards"], "per_rank": per_rank, "per_worker": per_worker}


def kinds(counts: Counter) -> Counter:
    out = Counter()
    for (kind, _), n in counts.items():
        out[kind] += n
    return out


def test_local_shards_one_open_per_touched_shard_by_the_rank_none_by_its_workers(job):
    t, row = job["trace"], job["row"]
    assert job["out"].count("local ") == WORLD
    assert t.count("local/manifest", job["shards"]) == Counter({("open", "manifest.json"): 1})
    opens = []
    for rank in range(WORLD):
        phase = f"local/rank{rank}"
        rank_ops = t.count(phase, job["shards"], "root")
        assert (set(rank_ops.values()) == {1}
                and kinds(rank_ops) == Counter(open=job["per_rank"][rank])), rank_ops
        assert {name for _, name in rank_ops} <= set(job["names"])
        workers = t.count(phase, job["shards"], "children")
        assert set(kinds(workers)) == {"read"}, workers  # preads on the rank's descriptors, nothing else
        assert len(t.processes(phase, "read", job["shards"])) == WORKERS
        opens.append(len(rank_ops))
    everything = kinds(t.count("local/", job["shards"]))
    assert everything["open"] == row["total"] and max(opens) == row["opens_per_rank_max"]
    assert everything["stat"] == row["stats"] == 0 and everything["fstat"] == 0  # not even on a descriptor
    assert everything["listing"] == row["listings"] == 0


def test_the_frame_folder_model_is_what_a_frame_folder_reader_does(job):
    """The planner's baseline against TSM's way of reading (an existence check of the first
    frame, then one open per frame): opens, stats and listings as ``layout.frame_folder_ops``
    says. (Python's ``open`` adds an fstat per file, which the model leaves out.)"""
    assert f"frames {FOLDERS}" in job["out"]
    seen = kinds(job["trace"].count("frames", job["frames"]))
    model = layout.frame_folder_ops(FOLDERS, 8)
    assert (seen["open"], seen["stat"], seen["listing"]) == (model.opens, model.stats, model.listings), seen


def test_over_http_one_get_per_shard_a_worker_touches_and_no_local_file(job):
    t, requests = job["trace"], job["requests"]
    assert requests["http/manifest"] == [("GET", "/v1/datasets/probe/manifest.json", 200)]
    total = 1
    for rank in range(WORLD):
        got = requests[f"http/rank{rank}"]
        assert {(m, s) for m, _, s in got} == {("GET", 206)}, got  # byte ranges, never a HEAD
        assert len(got) == job["per_worker"][rank], got
        total += len(got)
        assert len(t.processes(f"http/rank{rank}", "connect", "127.0.0.1")) == WORKERS
    assert total == job["row"]["total_per_worker_opens"]
    assert not t.count("http/", job["shards"])


def test_cache_downloads_each_shard_once_per_node_and_workers_read_descriptors(job):
    """Cold: each shard one GET and one rename into place, by the loader workers that read it.
    Warm: no request; a worker pins each copy it reads once (an open, the fstat that checks the
    copy is still linked, a utimensat that notes recency) and reads through that descriptor."""
    t, requests, cache = job["trace"], job["requests"], job["cache"]
    cold = [r for rank in range(WORLD) for r in requests[f"cache-cold/rank{rank}"]]
    assert sorted(path.removeprefix("/v1/datasets/probe/") for _, path, _ in cold) == sorted(job["names"])
    assert {(m, s) for m, _, s in cold} == {("GET", 206)}
    renamed = [name for (kind, name) in t.count("cache-cold/", cache) if kind == "rename"]
    assert len(renamed) == len(job["names"])
    for phase in ("cache-cold", "cache-warm"):
        assert requests[f"{phase}/manifest"] == [("GET", "/v1/datasets/probe/manifest.json", 200)]
        assert not t.count(f"{phase}/", job["shards"])
    once = Counter(open=WORKERS, fstat=WORKERS, utimensat=WORKERS)  # at most a pin per worker
    for rank in range(WORLD):
        phase = f"cache-warm/rank{rank}"
        assert requests[phase] == []
        # the rank leaves the copies to its workers
        assert {name for _, name in t.count(phase, cache, "root")} <= {"."}
        ops = t.count(phase, cache, "children")
        copies = {name for _, name in ops if name.endswith(".tar")}
        assert len(copies) == job["per_rank"][rank]
        assert {job["sha256"][os.path.basename(c).removesuffix(".tar")] for c in copies} <= set(job["names"])
        for copy in copies:
            assert Counter({kind: n for (kind, name), n in ops.items() if name == copy
                            and kind != "read"}) <= once, ops
        directories = {name for _, name in ops} - copies  # os.makedirs: the cache and the copies' folders
        assert directories <= {"."} | {os.path.dirname(c) for c in copies}, ops
        assert "listing" not in kinds(ops), ops
