"""The service out of the byte path, and integrity end to end, against real servers on loopback:
the per-sample digests and the server's ETag catching a shard corrupted in place, one manifest
parse for 32 first requests, Cache-Control behind a real nginx ``proxy_cache``, ``--workers 2``,
and a ``307`` to a presigned URL of moto's S3 server followed with the right bytes."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from http.server import ThreadingHTTPServer

import psutil
import pytest
from helpers.required import require
from helpers.shardsets import RangeHandler, ServiceProcess, corrupt_sample, http, make_shardset, register

from shards.catalog import Catalog
from shards.format.digests import CorruptSample
from shards.format.manifest import Manifest
from shards.format.sample import parse
from shards.io.http_range import RangeError
from shards.read.reading import iter_samples, open_range

NGINX = "/usr/sbin/nginx"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stats(url: str) -> dict:
    return json.loads(http(url, path="/v1/stats")[2])["total"]


def until(condition, what: str, seconds: float = 60):
    """Wait for a state (not a time): fail naming it if it never comes."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def listening(proc: subprocess.Popen, port: int, what: str) -> None:
    """Wait until ``proc`` accepts connections on ``port``; fail if it exits first."""
    def up():
        assert proc.poll() is None, f"{what} exited"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False
    until(up, f"{what} listening")


def stop_tree(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and what it started, if still running (a fixture's failure path)."""
    if proc.poll() is None:
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("bytes")
    cat = Catalog(str(root / "catalog.sqlite"))
    sets = {}
    for name in ("alpha", "beta", "rot", "changed", "flagged"):
        make_shardset(str(root / name), {"train": 12 if name == "beta" else 8}, per_shard=4)
        sets[name] = register(cat, str(root / name), name)
    cat.tag(sets["alpha"].id, "prod")
    server = ServiceProcess("--catalog", str(root / "catalog.sqlite"))
    server.start()
    yield {"root": root, "catalog": cat, "sets": sets, "server": server}
    server.kill(15)


def loader_batches(url: str, direct: str = "never"):
    from trainer.data import ClipLoader, EpochOptions

    return list(ClipLoader(url, "train", EpochOptions(batch_size=4), num_workers=0, crop_size=32,
                           scale_size=36, direct_reads=direct))


# --- integrity ---------------------------------------------------------------------------------
def test_bit_rot_is_caught_by_the_per_sample_digest_over_http(env):
    url = env["server"].url
    # the server cannot tell: same size and mtime
    shard = corrupt_sample(env["root"] / "rot", keep_mtime=True)
    before = stats(url)["shard_requests"]
    with pytest.raises(CorruptSample) as e:
        loader_batches(f"{url}/v1/datasets/rot")
    message = str(e.value)
    assert (f"{url}/v1/datasets/rot/{shard.name}" in message and shard.keys[2] in message
            and "read twice" in message)
    assert stats(url)["shard_requests"] - before >= 2  # the sample was asked for again before giving up


class FlipsOnce(RangeHandler):
    """Static files with ranges; the first answer for a shard has a byte flipped on the way."""

    def send_head(self):
        body = super().send_head()
        if body is not None and self.path.endswith(".tar") and not self.server.flipped:
            self.server.flipped = True
            data = bytearray(body.read())
            data[len(data) // 2] ^= 0x01
            body = io.BytesIO(bytes(data))
        return body


def test_a_sample_damaged_once_on_the_way_is_read_again_and_passes(tmp_path):
    m = make_shardset(str(tmp_path / "set"), {"train": 4}, per_shard=4)
    shard = m.splits["train"].shards[0]
    origin = ThreadingHTTPServer(("127.0.0.1", 0), partial(FlipsOnce, directory=str(tmp_path / "set")))
    origin.requests, origin.flipped = [], False
    threading.Thread(target=origin.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{origin.server_address[1]}/{shard.name}"
        got = [[bytes(f) for f in sample.frames] for _, sample in iter_samples(url, shard, 0, 4)]
    finally:
        origin.shutdown()
        origin.server_close()
    raw = (tmp_path / "set" / shard.name).read_bytes()
    assert got == [[bytes(f) for f in parse(raw[o:o + n], k, label=label).frames]
                   for o, n, k, label in zip(shard.offsets, shard.lengths, shard.keys, shard.labels)]
    assert origin.flipped and len(origin.requests) == 2  # the range, then the one damaged sample again


def test_format_1_sets_are_still_read(tmp_path):
    """A set written before per-sample digests: its manifest says format /1 and has none."""
    from shards.tools.verify import verify

    make_shardset(str(tmp_path / "old"), {"train": 8}, per_shard=4)
    path = tmp_path / "old" / "manifest.json"
    old = json.loads(path.read_bytes())
    old["format"] = "kinetics-fast-shards/1"
    for shard in old["splits"]["train"]["shards"]:
        del shard["digests"]
    path.write_text(json.dumps(old))
    m = Manifest.load(str(tmp_path / "old"))
    assert m.format == "kinetics-fast-shards/1" and m.splits["train"].shards[0].digests == []
    assert verify(m) == [] and sum(len(b["keys"]) for b in loader_batches(str(tmp_path / "old"))) == 8


def test_file_tables_keep_the_most_recently_used(env):
    import asyncio

    from service.stats import Counters
    from service.tables import FileTables

    sets = env["sets"]
    tables = FileTables(env["catalog"], Counters(), limit=2)
    order = ["alpha", "beta", "alpha", "rot", "beta", "alpha"]  # rot evicts beta; then beta evicts alpha

    async def ask():
        for name in order:
            await tables.table(env["catalog"].get(sets[name].id))
    asyncio.run(ask())
    assert tables.counters.rows()[0]["manifest_parses"] == 5
    assert [key[0] for key in tables.tables] == [sets["beta"].id, sets["alpha"].id]


def test_a_changed_shard_is_hashed_again_and_its_etag_refused(env):
    url, cat, rec = env["server"].url, env["catalog"], env["sets"]["changed"]
    shard = corrupt_sample(env["root"] / "changed", keep_mtime=False)
    with pytest.raises(RangeError, match="status 409"):  # hashed again: not the manifest's bytes, so damaged
        open_range(f"{url}/v1/datasets/changed/{shard.name}", 0, 100, size=shard.bytes,
                   sha256=shard.sha256).read()
    assert stats(url)["reverified"] == 1
    rec = cat.get(rec.id)
    assert rec.verify_problems == 1 and shard.name in rec.verify_detail
    status, headers, _ = http(url, "HEAD", f"/v1/datasets/changed/{shard.name}",
                              headers={"Prefer": "handling=lenient"})
    assert (status == 200
            and headers["etag"] == f'"{rec.verified_files[shard.name][2]}"' != f'"{shard.sha256}"')


LENIENT = {"Prefer": "handling=lenient"}


def test_a_set_verify_found_bad_is_not_served_as_sound(env, tmp_path):
    """As a new user tried it: a byte flipped, ``verify`` reported it, training from the URL must fail,
    saying why and what to do. Before: every file went on being served with 200 (only a client
    checking ETags noticed), and training died with a 114-line traceback after five retries."""
    url, rec = env["server"].url, env["sets"]["flagged"]
    shard = corrupt_sample(env["root"] / "flagged", keep_mtime=False)
    out = subprocess.run([sys.executable, "-m", "service", "verify",
                          "--catalog", env["catalog"].path, "flagged"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and f"{shard.name}: SHA-256 differs" in out.stdout
    assert env["catalog"].get(rec.id).verify_problems == 2  # that and the sample's digest
    for name in ("manifest.json", "classes.txt", shard.name,
                 Manifest.load(rec.location).splits["train"].shards[1].name):
        for method in ("GET", "HEAD"):  # every file of the set, the sound shard too: the set is not sound
            status, headers, body = http(url, method, f"/v1/datasets/flagged/{name}")
            assert status == 409 and headers["cache-control"] == "no-store", (name, method, status)
    error = json.loads(http(url, path=f"/v1/datasets/{rec.id}/manifest.json")[2])["error"]
    assert f"dataset {rec.id} (flagged) is damaged" in error and f"{shard.name}: SHA-256 differs" in error
    assert f"shard-service verify {rec.id[:12]}" in error and "Prefer: handling=lenient" in error
    # training from the URL: one line with the server's reason, no traceback
    train = subprocess.run([sys.executable, "-m", "trainer", "train", "--data", f"{url}/v1/datasets/flagged",
                            "--output-dir", str(tmp_path / "run"), "--backend", "none", "--workers", "0"],
                           capture_output=True, text=True, timeout=300)
    lines = [line for line in train.stderr.splitlines() if ": error: " in line]
    assert train.returncode == 1 and "Traceback" not in train.stderr and len(lines) == 1, train.stderr[-3000:]
    assert (lines[0].startswith("trainer train: error: ") and "HTTP 409" in lines[0]
            and "is damaged" in lines[0])
    # asked for explicitly, the files as they are: what verify hashed, never cached, the preference said
    # applied
    status, headers, _ = http(url, "HEAD", f"/v1/datasets/{rec.id}/{shard.name}", headers=LENIENT)
    assert status == 200 and headers["etag"] != f'"{shard.sha256}"'
    assert headers["preference-applied"] == "handling=lenient" and headers["cache-control"] == "no-store"
    assert stats(url)["reverified"] <= 1  # verify's stamps are current: nothing hashed again by the server


def test_a_range_of_5000_digits_is_read_as_the_rfc_says(env):
    """RFC 9110 §14.1.1: a position is 1*DIGIT, so 5,000 digits are a valid range, whose numbers
    are past any end: as a first byte unsatisfiable (416, ``Content-Range: bytes */SIZE``), as a
    last byte the representation's end (206 with the whole file), as a suffix longer than the
    file the whole file (206); leading zeros are only zeros (bytes 5-9). Never a 500 (Python's
    int refuses strings of over 4,300 digits), and not 416 for the satisfiable ones (what a server
    comparing the number's length, not its value, would answer)."""
    url, rec = env["server"].url, env["sets"]["alpha"]
    name = Manifest.load(rec.location).splits["train"].shards[0].name
    data = (env["root"] / "alpha" / name).read_bytes()
    size, many = len(data), "9" * 5000
    for header, status, span in ((f"bytes={many}-", 416, None), (f"bytes=0-{many}", 206, (0, size)),
                                 (f"bytes=-{many}", 206, (0, size)), ("bytes=" + "0" * 4990 + "5-9", 206,
                                                                      (5, 10))):
        got, headers, body = http(url, path=f"/v1/datasets/alpha/{name}", headers={"Range": header})
        assert got == status, (header[:20], got, body[:200])
        if span is None:
            assert headers["content-range"] == f"bytes */{size}"
        else:
            assert (headers["content-range"] == f"bytes {span[0]}-{span[1] - 1}/{size}"
                    and body == data[slice(*span)])
    assert http(url, path="/v1/health")[0] == 200


# --- direct reads ------------------------------------------------------------------------------
def test_a_visible_set_is_read_directly_with_no_shard_byte_through_the_server(env, caplog):
    url, alpha = env["server"].url, env["sets"]["alpha"]
    local = loader_batches(alpha.location)
    before = stats(url)
    with caplog.at_level("INFO", logger="shards.read.direct"):
        direct = loader_batches(f"{url}/v1/datasets/alpha", "auto")
    assert (stats(url)["shard_bytes"] == before["shard_bytes"]
            and stats(url)["shard_requests"] == before["shard_requests"])
    assert f"its 2 shards are read directly from {alpha.location}" in caplog.text
    assert [b["keys"] for b in direct] == [b["keys"] for b in local]
    assert all((a["clips"] == b["clips"]).all() for a, b in zip(local, direct))
    loader_batches(f"{url}/v1/datasets/alpha", "never")  # the same set through the server: counted
    assert stats(url)["shard_bytes"] - before["shard_bytes"] == sum(  # every sample, once
        sum(s.lengths) for s in Manifest.load(alpha.location).splits["train"].shards)


def test_direct_reads_fall_back_or_fail_when_the_files_are_not_the_served_ones(env, tmp_path):
    from shards.read.direct import NoDirectRead, resolve

    url, cat = env["server"].url, env["catalog"]
    make_shardset(str(tmp_path / "moved"), {"train": 8}, per_shard=4)
    rec = register(cat, str(tmp_path / "moved"), "moved")
    manifest = tmp_path / "moved" / "manifest.json"  # not the manifest the catalog recorded, still one
    manifest.write_text(json.dumps(json.loads(manifest.read_text()), indent=2))
    assert resolve(f"{url}/v1/datasets/moved", "auto") == f"{url}/v1/datasets/moved"
    with pytest.raises(NoDirectRead, match="SHA-256 differs"):
        resolve(f"{url}/v1/datasets/moved", "always")
    shutil.rmtree(tmp_path / "moved")
    with pytest.raises(NoDirectRead, match="not visible here"):
        resolve(f"{url}/v1/datasets/{rec.id}", "always")


# --- cache headers, behind a real nginx proxy_cache --------------------------------------------
@pytest.fixture(scope="module")
def proxy(env, tmp_path_factory):
    require("nginx", None if os.path.exists(NGINX) else f"{NGINX} missing: scripts/test.sh installs Debian's "
                                                        f"nginx-light")
    prefix = tmp_path_factory.mktemp("nginx")
    port, upstream = free_port(), env["server"].url.split("//")[1]
    conf = prefix / "nginx.conf"
    conf.write_text(f"""user root; worker_processes 1; daemon off; pid {prefix}/nginx.pid;
error_log {prefix}/error.log;
events {{ worker_connections 256; }}
http {{ access_log off; client_body_temp_path {prefix}/t1; proxy_temp_path {prefix}/t2;
  fastcgi_temp_path {prefix}/t3; uwsgi_temp_path {prefix}/t4; scgi_temp_path {prefix}/t5;
  proxy_cache_path {prefix}/cache keys_zone=shards:10m;
  server {{ listen 127.0.0.1:{port};
    location / {{ proxy_pass http://{upstream}; proxy_http_version 1.1; proxy_cache shards;
                  add_header X-Cache-Status $upstream_cache_status; }} }} }}
""")
    proc = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(prefix)])
    try:
        listening(proc, port, "nginx")
        yield f"http://127.0.0.1:{port}"
        proc.send_signal(signal.SIGQUIT)  # a graceful stop: its worker too
        proc.wait(timeout=60)
    finally:  # never started, or did not stop: the master and its worker (its only child)
        stop_tree(proc)


def test_responses_say_how_they_may_be_cached(env):
    url, rec = env["server"].url, env["sets"]["alpha"]
    shard = Manifest.load(rec.location).splits["train"].shards[0].name
    assert (http(url, path=f"/v1/datasets/{rec.id}/{shard}")[1]["cache-control"]
            == "public, max-age=31536000, immutable")
    for ref in ("alpha", "prod", rec.id[:10]):
        assert http(url, path=f"/v1/datasets/{ref}/{shard}")[1]["cache-control"] == "no-cache"
    for path in ("/v1/health", "/v1/stats", "/v1/datasets", f"/v1/datasets/{rec.id}",
                 "/v1/datasets/none/x.tar"):
        assert http(url, path=path)[1]["cache-control"] == "no-store", path


def test_a_proxy_serves_repeated_reads_by_id_and_never_a_moved_tag_stale(env, proxy):
    url, cat, alpha, beta = env["server"].url, env["catalog"], env["sets"]["alpha"], env["sets"]["beta"]
    shard = Manifest.load(alpha.location).splits["train"].shards[1]
    data = (env["root"] / "alpha" / shard.name).read_bytes()
    path = f"/v1/datasets/{alpha.id}/{shard.name}"
    cache = []
    for _ in range(2):
        before = stats(url)["shard_requests"]
        status, headers, body = http(proxy, path=path, headers={"Range": "bytes=100-5099"})
        assert status == 206 and body == data[100:5100] and headers["etag"] == f'"{shard.sha256}"'
        cache.append((headers["x-cache-status"], stats(url)["shard_requests"] - before))
    assert cache == [("MISS", 1), ("HIT", 0)]  # the second read never reached the server
    # the project's range client through the proxy: checked bytes, and still not from the server
    before = stats(url)["shard_requests"]
    assert open_range(f"{proxy}{path}", 7, 9007, size=shard.bytes, sha256=shard.sha256).read() == data[7:9007]
    assert stats(url)["shard_requests"] == before
    manifests = [(env["root"] / n / "manifest.json").read_bytes() for n in ("alpha", "beta")]
    assert manifests[0] != manifests[1]
    assert http(proxy, path="/v1/datasets/prod/manifest.json")[2] == manifests[0]
    cat.tag(beta.id, "prod")
    try:
        assert http(proxy, path="/v1/datasets/prod/manifest.json")[2] == manifests[1]  # at once
    finally:
        cat.tag(alpha.id, "prod")


# --- the server: single flight, workers --------------------------------------------------------
class Gated(RangeHandler):
    """Static files; a GET of a manifest waits for ``server.gate``, and is counted."""

    def send_head(self):
        if self.path.endswith("/manifest.json"):
            self.server.manifests += 1
            self.server.gate.wait(120)
        return super().send_head()


# long: 30 s on 2 cores (32 first requests held at a gated origin until all have arrived); the suite
# keeps the other byte-range and manifest tests of this file
@pytest.mark.long
def test_32_first_requests_parse_the_manifest_once(env, tmp_path):
    make_shardset(str(tmp_path / "far"), {"train": 8}, per_shard=4)
    origin = ThreadingHTTPServer(("127.0.0.1", 0), partial(Gated, directory=str(tmp_path)))
    origin.requests, origin.manifests, origin.gate = [], 0, threading.Event()
    origin.daemon_threads = True
    threading.Thread(target=origin.serve_forever, daemon=True).start()
    url = env["server"].url
    try:
        local = register(env["catalog"], str(tmp_path / "far"), "far")
        cat = env["catalog"]
        with cat._write() as db:  # the same set, found at an HTTP location whose manifest answers on demand
            db.execute("UPDATE datasets SET location = ? WHERE id = ?",
                       (f"http://127.0.0.1:{origin.server_address[1]}/far", local.id))
        shard = Manifest.load(str(tmp_path / "far")).splits["train"].shards[0]
        before = stats(url)
        with ThreadPoolExecutor(32) as pool:
            answers = [pool.submit(http, url, path=f"/v1/datasets/{local.id}/{shard.name}")
                       for _ in range(32)]
            until(lambda: stats(url)["table_waiting"] == 32, "32 requests waiting for the file table")
            origin.gate.set()
            statuses = [a.result()[0] for a in answers]
        assert statuses == [200] * 32
        assert stats(url)["manifest_parses"] - before["manifest_parses"] == 1 and origin.manifests == 1
    finally:
        origin.gate.set()
        origin.shutdown()
        origin.server_close()


def test_two_workers_serve_from_one_catalog(env):
    cat, beta = env["catalog"], env["sets"]["beta"]
    server = ServiceProcess("--catalog", cat.path, "--workers", "2")
    url = server.start()
    try:
        pids = {json.loads(http(url, path="/v1/stats")[2])["pid"] for _ in range(40)}  # a connection each
        assert len(pids) == 2 and server.proc.pid not in pids
        cat.tag(beta.id, "moving")  # a commit to the one catalog, seen by both
        seen = {(json.loads(b)["pid"], json.loads(r)["id"]) for b, r in
                ((http(url, path="/v1/stats")[2], http(url, path="/v1/datasets/moving")[2])
                 for _ in range(30))}
        assert {rid for _, rid in seen} == {beta.id}
        rows = json.loads(http(url, path="/v1/stats")[2])["workers"]
        assert len(rows) == 2 and all(r["requests"] > 0 for r in rows)
    finally:
        cat.untag("moving")
        server.kill(15)
    assert server.proc.returncode == 0


# --- a 307 to a presigned URL of moto's S3 server ------------------------------------------------
@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    port = free_port()
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
             "AWS_DEFAULT_REGION": "us-east-1"}
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", "127.0.0.1",
                             "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **creds})
    endpoint = f"http://127.0.0.1:{port}"
    try:
        listening(proc, port, "moto's server")
        yield endpoint, {**creds, "AWS_ENDPOINT_URL": endpoint}
        proc.terminate()
        proc.wait(timeout=60)
    finally:
        stop_tree(proc)


def test_a_redirect_to_a_presigned_url_is_followed_and_no_byte_goes_through_the_server(env, moto, tmp_path):
    import s3fs

    from ingest.registry import describe_set

    endpoint, s3env = moto
    local = tmp_path / "s3set"
    make_shardset(str(local), {"train": 8}, per_shard=4)
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing", skip_instance_cache=True)
    fs.mkdir("kf-redirect")
    fs.put(str(local), "kf-redirect/set", recursive=True)
    cat = Catalog(str(tmp_path / "catalog.sqlite"))
    claim = cat.claim("ab" * 32, source="tests", location="s3://kf-redirect/set", options={}, name="ons3")
    splits, files, sha = describe_set(str(local))  # the same bytes as uploaded
    cat.finish(claim.record.id, claim.owner, splits=splits, files=files, manifest_sha256=sha,
               builder_version="tests")
    server = ServiceProcess("--catalog", cat.path, "--redirect", "300", env={**os.environ, **s3env})
    url = server.start()
    try:
        shard = Manifest.load(str(local)).splits["train"].shards[1]
        data = (local / shard.name).read_bytes()
        status, headers, _ = http(url, path=f"/v1/datasets/ons3/{shard.name}")
        assert status == 307 and headers["location"].startswith(f"{endpoint}/kf-redirect/set/{shard.name}?")
        assert headers["cache-control"] == "no-store"
        got = open_range(f"{url}/v1/datasets/ons3/{shard.name}", 11, 7011, size=shard.bytes,
                         sha256=shard.sha256)
        assert got.read() == data[11:7011]
        batches = loader_batches(f"{url}/v1/datasets/ons3")  # every shard read, every sample checked
        assert sum(len(b["keys"]) for b in batches) == 8
        served = stats(url)
        assert served["redirects"] >= 3 and served["shard_bytes"] == 0
    finally:
        server.kill(15)
