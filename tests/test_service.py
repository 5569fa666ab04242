"""The dataset service, started for real (``shard-service serve`` on a loopback port) over a real
catalog file: ranges and conditional requests byte-exact against the file (from the service, and
from a real nginx sending the bytes a replica of it hands over: ``--x-accel-redirect``), path
traversal, tokens, bad requests, builds asked for over HTTP (ten at once make one), a restart that
takes the killed server's build over, and training batches read through it equal to those read
from disk."""
from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from email.utils import formatdate

import pytest
from helpers import media
from helpers.fronts import Front, accel_flags
from helpers.shardsets import ServiceProcess, http, make_shardset, register, wait_for

from shards.catalog import Catalog
from shards.format.manifest import Manifest

TOKEN = "s3cret-token-for-tests"
SECRET = b"SECRET-BYTES-OUTSIDE-EVERY-SET"


@pytest.fixture(scope="module")
def env(tmp_path_factory, ray_local, videos):
    root = tmp_path_factory.mktemp("service")
    make_shardset(str(root / "tiny"), {"train": 20, "val": 8}, per_shard=5)
    make_shardset(str(root / "linked"), {"train": 10, "val": 5}, per_shard=5)
    (root / "secret.txt").write_bytes(SECRET)
    shard = root / "linked" / "train" / "train-000001.tar"  # a symbolic link planted inside a set
    shard.unlink()
    shard.symlink_to(root / "secret.txt")
    cat = Catalog(str(root / "catalog.sqlite"))
    tiny = register(cat, str(root / "tiny"), "tiny")
    register(cat, str(root / "linked"), "linked")
    cat.tag(tiny.id, "prod")
    building = cat.claim("ee" * 32, source="tests", location=str(root / "half"), options={}, name="half")
    (root / "tokens").write_text(f"# writers\n{TOKEN}\n")
    make_source_trees(root)
    server = ServiceProcess("--catalog", str(root / "catalog.sqlite"), "--token-file", str(root / "tokens"),
                            "--data-root", str(root / "sets"), "--ray-address",
                            ray_local.get_runtime_context().gcs_address, "--source-root", str(videos),
                            "--source-root", str(root / "sources"), "--source-root", "s3://bucket/videos",
                            "--max-build-workers", "4")
    server.start()
    yield {"root": root, "server": server, "catalog": cat, "tiny": tiny, "building": building.record}
    server.kill(15)


@pytest.fixture(scope="module", params=["service", "nginx sending the bytes"])
def front(request, env, tmp_path_factory):
    """Where the byte-exact tests read: the service itself, and nginx in front of a replica of it
    on the same catalog started with --x-accel-redirect (``service.accel``): the answers must be
    the same, byte for byte and header for header."""
    if request.param == "service":
        yield env["server"].url
        return
    prefix = tmp_path_factory.mktemp("front")
    replica = ServiceProcess("--catalog", str(env["root"] / "catalog.sqlite"), *accel_flags(str(prefix)))
    replica.start()
    nginx = Front(prefix, [replica.url.split("//")[1]])
    try:
        yield nginx.start().url
        redirected = json.loads(http(replica.url, path="/v1/stats")[2])["total"]["accel_redirects"]
        assert redirected > 0, "nginx sent no file for the replica"
    finally:
        nginx.stop()
        replica.kill(15)


def shard_of(env, index=0):
    m = Manifest.load(str(env["root"] / "tiny"))
    shard = m.splits["train"].shards[index]
    return shard, (env["root"] / "tiny" / shard.name).read_bytes()


def test_catalog_routes(env):
    url, tiny = env["server"].url, env["tiny"]
    status, _, body = http(url, path="/v1/health")
    assert status == 200 and json.loads(body)["datasets"]["ready"] == 2
    status, _, body = http(url, path="/v1/datasets")
    assert status == 200 and {d["name"] for d in json.loads(body)["datasets"]} == {"tiny", "linked", "half"}
    for ref in (tiny.id, "tiny", "prod", tiny.id[:8]):
        status, _, body = http(url, path=f"/v1/datasets/{ref}")
        record = json.loads(body)
        assert status == 200 and record["id"] == tiny.id and record["tags"] == ["prod"]
        # bytes: the shard files' sizes on disk
        for split, clips, shards in (("train", 20, 4), ("val", 8, 2)):
            on_disk = sum(p.stat().st_size for p in (env["root"] / "tiny" / split).glob("*.tar"))
            assert record["splits"][split] == {"clips": clips, "bytes": on_disk, "shards": shards,
                                               "failed": 0}
    status, headers, body = http(url, path="/v1/datasets/nothing-here")
    assert status == 404 and headers["content-type"].startswith("application/json")
    assert "nothing-here" in json.loads(body)["error"]


RANGES = [  # Range header -> expected status and [start, end) (None: the 4xx cases)
    ("bytes=0-99", 206, (0, 100)),
    ("bytes=100-100", 206, (100, 101)),
    ("bytes=-100", 206, ("size-100", "size")),
    ("bytes=1000-", 206, (1000, "size")),
    ("bytes=10-99999999", 206, (10, "size")),  # the end is clamped
    ("bytes=-99999999", 206, (0, "size")),  # a suffix longer than the file: all of it
    ("bytes=0-", 206, (0, "size")),
    ("bytes=size-", 416, None),
    ("bytes=size-size", 416, None),
    ("bytes=99999999-", 416, None),
    ("bytes=-0", 416, None),
    ("bytes=0-1,5-9", 416, None),  # multiple ranges: one range per request
    ("bytes=" + ",".join(["0-"] * 2000), 416, None),
    ("bytes=9-5", 400, None),
    ("bytes=abc", 400, None),
    ("bytes=-", 400, None),
    ("bytes=1-2-3", 400, None),
    ("items=0-9", 200, (0, "size")),  # another unit is ignored
]


@pytest.mark.parametrize("header, status, span", RANGES)
def test_range_table_byte_exact(env, front, header, status, span):
    shard, data = shard_of(env)
    size = len(data)
    sub = lambda v: size - 100 if v == "size-100" else size if v == "size" else v  # noqa: E731
    got, headers, body = http(front, path=f"/v1/datasets/tiny/{shard.name}",
                              headers={"Range": header.replace("size", str(size))})
    assert got == status
    assert headers["etag"] == f'"{shard.sha256}"' and headers["accept-ranges"] == "bytes"
    if span is None:
        assert "error" in json.loads(body)
        if status == 416:
            assert headers["content-range"] == f"bytes */{size}"
        return
    start, end = sub(span[0]), sub(span[1])
    assert body == data[start:end] and int(headers["content-length"]) == end - start
    if status == 206:
        assert headers["content-range"] == f"bytes {start}-{end - 1}/{size}"
    else:
        assert "content-range" not in headers


def test_head_answers_like_get_without_a_body(env, front):
    shard, data = shard_of(env)
    path = f"/v1/datasets/tiny/{shard.name}"
    for extra in ({}, {"Range": "bytes=0-9"}):  # Range is for GET only (RFC 9110 14.2)
        status, headers, body = http(front, "HEAD", path, extra)
        assert status == 200 and body == b"" and int(headers["content-length"]) == len(data)
        assert headers["etag"] == f'"{shard.sha256}"' and headers["content-type"] == "application/x-tar"


def test_etag_if_none_match_if_range_and_if_match(env, front):
    shard, data = shard_of(env, 1)
    url, path, etag = front, f"/v1/datasets/tiny/{shard.name}", f'"{shard.sha256}"'
    status, headers, body = http(url, path=path, headers={"If-None-Match": etag})
    assert status == 304 and body == b"" and headers["etag"] == etag
    assert http(url, path=path, headers={"If-None-Match": f'W/{etag}, "other"'})[0] == 304  # weak comparison
    assert http(url, path=path, headers={"If-None-Match": '"other"'})[0] == 200
    status, _, body = http(url, path=path, headers={"Range": "bytes=5-9", "If-Range": etag})
    assert status == 206 and body == data[5:10]
    status, _, body = http(url, path=path, headers={"Range": "bytes=5-9", "If-Range": '"changed"'})
    assert status == 200 and body == data  # the validator failed: the whole current file
    status, _, body = http(url, path=path, headers={"Range": "bytes=5-9", "If-Range": f"W/{etag}"})
    assert status == 200 and body == data  # If-Range needs a strong match
    # the file's own date
    mtime = formatdate((env["root"] / "tiny" / shard.name).stat().st_mtime, usegmt=True)
    status, headers, body = http(url, path=path, headers={"Range": "bytes=5-9", "If-Range": mtime})
    assert status == 200 and body == data and "last-modified" not in headers  # dates are never validated
    status, _, body = http(url, path=path, headers={"If-Modified-Since": mtime})
    assert status == 200 and body == data
    assert http(url, path=path, headers={"If-Match": '"other"'})[0] == 412
    assert http(url, path=path, headers={"If-Match": etag})[0] == 200
    status, headers, body = http(url, path="/v1/datasets/tiny/manifest.json")
    assert status == 200 and headers["etag"] == f'"{env["tiny"].manifest_sha256}"'
    assert body == (env["root"] / "tiny" / "manifest.json").read_bytes()


TRAVERSALS = [
    b"/v1/datasets/tiny/../../../../../../etc/passwd",
    b"/v1/datasets/tiny/train/../manifest.json",
    b"/v1/datasets/tiny/./manifest.json",
    b"/v1/datasets/tiny/%2e%2e/%2e%2e/secret.txt",
    b"/v1/datasets/tiny/..%2f..%2fsecret.txt",
    b"/v1/datasets/tiny/%2E%2E%2F%2E%2E%2Fsecret.txt",
    b"/v1/datasets/tiny/%252e%252e%252f%252e%252e%252fsecret.txt",
    b"/v1/datasets/tiny/..\\..\\secret.txt",
    b"/v1/datasets/tiny/..%5c..%5csecret.txt",
    b"/v1/datasets/tiny//etc/passwd",
    b"/v1/datasets/tiny/%2fetc%2fpasswd",
    b"/v1/datasets/tiny/manifest.json%00.tar",
    b"/v1/datasets/tiny/manifest.json\x00.tar",
    b"/v1/datasets/tiny/%c0%ae%c0%ae/%c0%ae%c0%ae/secret.txt",
    b"/v1/datasets/tiny/\xc0\xae\xc0\xae/secret.txt",
    b"/v1/datasets/%2e%2e/tiny/manifest.json",
    b"/v1/datasets/tiny/train/train-000000.tar/../../classes.txt",
    b"/v1/datasets/tiny/../secret.txt",
]
NOT_IN_THE_SET = [  # plain paths: looked up in the set's file table
    b"/v1/datasets/tiny/secret.txt",
    b"/v1/datasets/tiny/etc/passwd",
    b"/v1/datasets/tiny/train",
    b"/v1/datasets/linked/train/train-000001.tar",  # the planted symbolic link
]


@pytest.mark.parametrize("raw", TRAVERSALS + NOT_IN_THE_SET, ids=[
    t.decode("latin-1").encode("unicode_escape").decode()[17:] for t in TRAVERSALS + NOT_IN_THE_SET])
def test_traversal_gets_4xx_and_no_byte_of_any_other_file(env, raw):
    status, headers, body = http(env["server"].url, raw_path=raw)
    assert (status == 400) if raw in TRAVERSALS else (status in (403, 404)), (status, body[:200])
    assert SECRET not in body and b"root:" not in body and b'"format"' not in body and b"ustar" not in body
    assert len(body) < 400


def test_a_symlink_planted_inside_a_set_is_refused_with_headers_too(env, front):
    status, _, body = http(front, "HEAD", "/v1/datasets/linked/train/train-000001.tar")
    assert status == 403 and body == b""
    status, _, body = http(front, path="/v1/datasets/linked/train/train-000001.tar")
    assert status == 403 and b"not a regular file inside the set" in body and SECRET not in body
    status, _, body = http(front, path="/v1/datasets/linked/train/train-000000.tar")
    assert status == 200  # the rest of the set is served


def test_writes_need_the_token(env):
    url, tiny = env["server"].url, env["tiny"]
    body = json.dumps({"src": str(env["root"])}).encode()
    status, headers, answer = http(url, "POST", "/v1/builds", body=body)
    assert status == 401 and headers["www-authenticate"].startswith("Bearer")
    for wrong in ("Bearer nope", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}"):
        assert http(url, "POST", "/v1/builds", {"Authorization": wrong}, body)[0] == 403
    assert http(url, "PUT", f"/v1/datasets/{tiny.id}/tags/x", {"Authorization": "Bearer nope"})[0] == 403
    assert http(url, "DELETE", f"/v1/datasets/{tiny.id}", {"Authorization": f"Basic {TOKEN}"})[0] == 401
    assert http(url, "DELETE", f"/v1/datasets/{tiny.id}/tags/prod")[0] == 401
    assert env["catalog"].get(tiny.id).tags == ["prod"] and env["catalog"].get(tiny.id).state == "ready"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    status, _, answer = http(url, "PUT", f"/v1/datasets/{tiny.id}/tags/exp-1", auth)
    assert status == 200 and json.loads(answer)["tags"] == ["exp-1", "prod"]
    assert http(url, "DELETE", f"/v1/datasets/{tiny.id}", auth)[0] == 409  # tagged
    # the server now remembers exp-1 -> tiny
    assert http(url, path="/v1/datasets/exp-1/classes.txt")[0] == 200
    assert http(url, "DELETE", f"/v1/datasets/{tiny.id}/tags/exp-1", auth)[0] == 200
    assert env["catalog"].get(tiny.id).tags == ["prod"]
    assert http(url, path="/v1/datasets/exp-1/classes.txt")[0] == 404  # and forgets it at once
    env["catalog"].tag(env["building"].id, "exp-3")
    # a tag of another set
    status, _, answer = http(url, "DELETE", f"/v1/datasets/{tiny.id}/tags/exp-3", auth)
    assert status == 404 and "has no tag 'exp-3'" in json.loads(answer)["error"]
    assert env["catalog"].resolve("exp-3").id == env["building"].id
    env["catalog"].untag("exp-3")
    env["catalog"].tag(tiny.id, "exp-2")  # a write by another process: the same
    assert http(url, path="/v1/datasets/exp-2/classes.txt")[0] == 200
    env["catalog"].untag("exp-2")
    assert http(url, path="/v1/datasets/exp-2/classes.txt")[0] == 404


@pytest.mark.parametrize("body, status, says", [
    (b"{not json", 400, "not JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"frames": 8}', 400, "src is required"),
    (b'{"src": "/x", "frame": 8}', 400, "unknown keys: frame"),
    (b'{"src": "/x", "frames": "8"}', 400, "wrong type"),
    (b'{"src": "SOURCES/nonexistent"}', 400, "no videos found"),
    (b'{"src": "' + b"x" * 70000 + b'"}', 413, ""),
])
def test_bad_requests_get_a_clear_4xx_and_the_server_serves_on(env, body, status, says):
    body = body.replace(b"SOURCES", str(env["root"] / "sources").encode())
    got, headers, answer = http(env["server"].url, "POST", "/v1/builds", {"Authorization": f"Bearer {TOKEN}"},
                                body)
    assert got == status and headers["content-type"].startswith("application/json")
    assert says in json.loads(answer)["error"]
    assert http(env["server"].url, path="/v1/health")[0] == 200


def make_source_trees(root) -> None:
    """Beside the allowed trees, one outside every --source-root and links that point out to it."""
    (root / "outside" / "train" / "jump").mkdir(parents=True)
    (root / "outside" / "train" / "jump" / "private.mp4").write_bytes(SECRET)
    (root / "sources" / "sneaky" / "train").mkdir(parents=True)
    (root / "sources" / "link").symlink_to(root / "outside")
    (root / "sources" / "sneaky" / "train" / "jump").symlink_to(root / "outside" / "train" / "jump")


@pytest.mark.parametrize("src, says", [
    ("OUTSIDE", "which is under no --source-root"),
    ("SOURCES/../outside", "which is under no --source-root"),
    ("SOURCES/link", "which is under no --source-root"),
    ("SOURCES/link/train/..", "which is under no --source-root"),
    ("SOURCES/sneaky", "/sneaky/train/jump is a symbolic link to"),
    ("file://OUTSIDE", "which is under no --source-root"),
    ("http://127.0.0.1:9/videos", "http://127.0.0.1:9 is under no --source-root"),
    ("s3://bucket/videos2", "s3://bucket is under no --source-root"),
    ("s3://other/videos", "s3://other is under no --source-root"),
    ("s3://bucket/videos/../private", "dot segments"),
    ("s3://bucket/videos/%2e%2e/private", "dot segments"),
    ("s3://bucket/videos%2F..%2Fprivate", "encoded slashes"),
    ("s3://key:secret@bucket/videos", "credentials"),
    ("zip://a.mp4::s3://bucket/videos/a.zip", "chained URLs"),
])
def test_build_sources_outside_the_roots_are_refused(env, src, says):
    src = src.replace("SOURCES", str(env["root"]
                                     / "sources")).replace("OUTSIDE", str(env["root"] / "outside"))
    status, _, answer = http(env["server"].url, "POST", "/v1/builds", {"Authorization": f"Bearer {TOKEN}"},
                             json.dumps({"src": src, "short_side": 30}).encode())
    assert status == 403 and says in json.loads(answer)["error"], answer
    assert (SECRET not in answer and not [r for r in env["catalog"].list()
                                          if r.source.startswith(str(env["root"]))])


@pytest.mark.parametrize("options, says", [
    ({"workers": 100000}, "workers: 100000 is outside 1..4 (the server's --max-build-workers)"),
    ({"workers": 0}, "workers: 0 is outside 1..4 (the server's --max-build-workers)"),
    ({"timeout": 1e9}, "timeout: 1000000000.0 is outside 1..3600"),
    ({"videos_per_task": 10**6}, "videos_per_task: 1000000 is outside 1..1024"),
    ({"ffmpeg_threads": 1000}, "ffmpeg_threads: 1000 is outside 1..16"),
    ({"frames": 0}, "frames: 0 is outside 1..64"),
    ({"short_side": 100000}, "short_side: 100000 is outside 16..2048"),
    ({"quality": 101}, "quality: 101 is outside 1..100"),
    ({"shard_samples": 0}, "shard_samples: 0 is outside 1..1000000"),
    ({"shard_size": "1kB"}, "shard_size: 1000 is outside 1000000..68719476736"),
    ({"splits": ["train", "nope"]}, "splits: ['train', 'nope']: give some of train, val, test, each once"),
])
def test_run_options_out_of_bounds_are_refused_naming_the_rule(env, videos, options, says):
    status, _, answer = http(env["server"].url, "POST", "/v1/builds", {"Authorization": f"Bearer {TOKEN}"},
                             json.dumps({"src": str(videos), **options}).encode())
    assert status == 400 and json.loads(answer)["error"] == says


def test_sets_not_ready_are_never_served(env):
    half = env["building"]
    os.makedirs(half.location, exist_ok=True)
    status, _, body = http(env["server"].url, path=f"/v1/datasets/{half.id}/manifest.json")
    assert status == 409 and "not ready" in json.loads(body)["error"]
    assert http(env["server"].url, path=f"/v1/datasets/{half.id}")[0] == 200  # its record is


def batches(where, **kw):
    from trainer.data import ClipLoader, EpochOptions

    loader = ClipLoader(where, "train", EpochOptions(batch_size=4), num_workers=2, crop_size=32,
                        scale_size=36, **kw)
    return list(loader)


def test_training_batches_over_http_equal_those_from_disk(env):
    local = batches(str(env["root"] / "tiny"))
    remote = batches(f"{env['server'].url}/v1/datasets/tiny")
    assert [b["keys"] for b in remote] == [b["keys"] for b in local]
    assert all((a["clips"] == b["clips"]).all() and (a["labels"] == b["labels"]).all()
               for a, b in zip(local, remote))
    from shards.tools.verify import verify
    assert verify(Manifest.load(f"{env['server'].url}/v1/datasets/prod")) == []


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    return media.make_class_folders(tmp_path_factory.mktemp("videos"))


# long: 22-37 s on 2 cores (ten concurrent build requests and the one real build they share); the
# suite keeps the catalog routes and the refusals of build sources
@pytest.mark.long
def test_ten_identical_build_requests_make_one_build(env, videos):
    url = env["server"].url
    body = json.dumps({"src": str(videos), "splits": ["val"], "short_side": 30, "shard_samples": 2,
                       "name": "val-only"}).encode()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda _: http(url, "POST", "/v1/builds", auth, body), range(10)))
    assert {a[0] for a in answers} <= {200, 202} and 202 in {a[0] for a in answers}
    ids = {json.loads(a[2])["id"] for a in answers}
    assert len(ids) == 1
    dataset = ids.pop()
    done = wait_for(url, dataset, ("ready", "failed"))
    assert done["state"] == "ready" and done["attempts"] == 1, done
    assert done["progress"] == {"videos_done": 2, "videos_total": 2, "failed": 0, "shards_written": 1}
    status, _, answer = http(url, "POST", "/v1/builds", auth, body)
    assert status == 200 and json.loads(answer)["state"] == "ready"  # asked again: it is there
    status, _, manifest = http(url, path="/v1/datasets/val-only/manifest.json")
    assert status == 200 and Manifest.from_json(manifest).splits["val"].num_samples == 2


@pytest.mark.long  # a server killed mid-build and a second one taking the build over: a long run's
def test_restart_keeps_the_catalog_and_takes_the_killed_servers_build_over(env, videos):
    server, url = env["server"], env["server"].url
    body = json.dumps({"src": str(videos), "splits": ["train"], "short_side": 30, "shard_samples": 2,
                       "videos_per_task": 1, "workers": 1}).encode()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    status, _, answer = http(url, "POST", "/v1/builds", auth, body)
    assert status == 202
    dataset = json.loads(answer)["id"]
    # not the one of an earlier test's build, maybe still exiting
    builder = server.build_process(dataset=dataset)
    os.killpg(builder.pid, signal.SIGSTOP)  # held: it cannot finish before the server is killed
    before = json.loads(http(url, path="/v1/datasets")[2])["datasets"]
    server.kill()  # SIGKILL
    url = server.start()
    held = json.loads(http(url, path=f"/v1/builds/{dataset}")[2])
    assert held["state"] == "building" and held["lease_alive"]  # its build process, alive, holds the lease
    assert held["record"]["attempts"] == 1
    # it finds its server gone (stdin closed) and leaves, recording nothing
    os.killpg(builder.pid, signal.SIGCONT)
    builder.wait(timeout=60)
    done = wait_for(url, dataset, ("ready", "failed"))  # asking for its state finds it orphaned: taken over
    assert done["state"] == "ready" and done["attempts"] == 2, done
    assert Manifest.load(done["location"]).splits["train"].num_samples == 4
    assert any(f"build {dataset}: its builder (" in line and "is gone; taken over (attempt 2)" in line
               for line in server.log), "".join(server.log)[-3000:]
    after = json.loads(http(url, path="/v1/datasets")[2])["datasets"]
    assert {(d["id"], tuple(d["tags"])) for d in before} <= {(d["id"], tuple(d["tags"])) for d in after}
    assert http(url, path="/v1/datasets/prod/manifest.json")[0] == 200
    status, _, answer = http(url, "POST", "/v1/builds", auth, body)  # asked again: there it is
    assert status == 200 and json.loads(answer)["id"] == dataset
