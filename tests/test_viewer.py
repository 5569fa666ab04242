"""The dataset viewer (service/viewer.py, service/static/) against the real server on loopback:
its JSON and frame routes over raw HTTP, and its pages in Debian's headless chromium driven by
Selenium (the catalog, counts on the set page, every frame of the first clips page byte-equal to
the shard's JPEG, the class filter, the detail view, a hostile class name shown as text, no
console errors, and with --read-auth nothing before the token). Also ``shards.read.clipindex`` and
``shards preview``."""
from __future__ import annotations

import base64
import contextlib
import io
import json
import math
import re
import shutil
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from helpers.required import require
from helpers.shardsets import (
    ServiceProcess,
    frame_colour,
    frame_motion,
    http,
    make_class_set,
    make_shardset,
    register,
    serve,
)
from PIL import Image
from test_service import TRAVERSALS

from service.states import STATES
from shards.catalog import Catalog
from shards.format import motioncolour
from shards.format.manifest import Manifest
from shards.format.sample import parse
from shards.read.clipindex import ClipIndex

TOKEN = "viewer-token-for-tests"
HOSTILE = '<img src=x onerror="window.pwned=1">'  # a class folder name
HOSTILE_MESSAGE = "<script>window.pwned=2</script> moov atom not found"
CLASSES = ["walking", HOSTILE, "jumping"]
WORN = "train/train-000000.tar: SHA-256 differs from the manifest"  # what verify recorded of the worn set
GREEN = "rgb(230, 244, 234)"  # the background of a sound set's badge (.badge.tone-good)
MANY = [f"class {c:03d}, a Kinetics-like name" for c in range(400)]
MANY_COUNTS = [3 + (c * 37) % 29 for c in range(400)]  # 3 to 31 clips a class
MOTION_SIZE = (85, 64)  # the motion set's frames: not a whole number of 8-pixel cells wide


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("viewer")
    make_shardset(str(root / "tiny"), {"train": 24, "val": 6}, per_shard=6, classes=CLASSES)
    ledger = [{"path": f"train/{HOSTILE}/bad.mp4", "split": "train", "reason": "not a video",
               "ffmpeg": HOSTILE_MESSAGE},
              {"path": "val/walking/empty.mp4", "split": "val", "reason": "empty file", "ffmpeg": ""}]
    (root / "tiny" / "errors.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ledger))
    (root / "secret.txt").write_text("SECRET-BYTES-OUTSIDE-EVERY-SET")
    cat = Catalog(str(root / "catalog.sqlite"))
    tiny = register(cat, str(root / "tiny"), "tiny")
    cat.tag(tiny.id, "prod")
    make_shardset(str(root / "worn"), {"train": 6}, per_shard=6)  # a set `shard-service verify` found bad
    worn = register(cat, str(root / "worn"), "worn", dataset_id="cd" * 32)
    cat.record_verify(worn.id, 1, WORN, cat.get(worn.id).verified_files)
    cat.claim("ee" * 32, source="tests", location=str(root / "half"), options={}, name="half")  # never ready
    make_shardset(str(root / "moving"), {"train": 6}, per_shard=3, size=MOTION_SIZE, motion="mv")
    register(cat, str(root / "moving"), "moving")
    make_class_set(str(root / "many"), MANY_COUNTS, MANY)
    register(cat, str(root / "many"), "many")
    (root / "tokens").write_text(TOKEN + "\n")
    stack = contextlib.ExitStack()
    base, _ = stack.enter_context(serve(str(root)))  # the same set on another HTTP server: a remote set
    register(cat, f"{base}/tiny", "remote", dataset_id="ab" * 32)
    servers = {"open": ServiceProcess("--catalog", str(root / "catalog.sqlite")),
               "auth": ServiceProcess("--catalog", str(root / "catalog.sqlite"), "--read-auth",
                                      "--token-file", str(root / "tokens"))}
    try:
        for server in servers.values():
            server.start()
        yield {"root": root, "catalog": cat, "tiny": tiny, "ledger": ledger,
               "manifest": Manifest.load(str(root / "tiny")), **servers}
    finally:
        for server in servers.values():
            if server.proc:
                server.kill(15)
        stack.close()


def frame_bytes(site, split: str, n: int) -> list[bytes]:
    """Clip n's JPEGs, read from the shard file on disk."""
    clip = ClipIndex(site["manifest"]).split(split).clip(n)
    data = (site["root"] / "tiny" / clip.shard.name).read_bytes()[clip.offset:clip.offset + clip.length]
    return [bytes(f) for f in parse(data, clip.key, label=clip.label, motion=site["manifest"].motion).frames]


# --- shards.read.clipindex ----------------------------------------------------------------------------
def test_clip_index_agrees_with_reading_the_manifest_in_order(site):
    m = site["manifest"]
    index = ClipIndex(m)
    for name, split in m.splits.items():
        in_order = [(shard, i) for shard in split.shards for i in range(shard.num_samples)]
        part = index.split(name)
        assert len(part) == len(in_order)
        for n, (shard, i) in enumerate(in_order):
            clip = part.clip(n)
            assert (clip.shard.name, clip.index, clip.key) == (shard.name, i, shard.keys[i])
            assert clip.label == shard.labels[i]
        labels = [shard.labels[i] for shard, i in in_order]
        for c in range(len(CLASSES)):
            assert part.matching([c]).tolist() == [n for n, label in enumerate(labels) if label == c]
        assert part.histogram(len(CLASSES)).tolist() == [labels.count(c) for c in range(len(CLASSES))]
        with pytest.raises(IndexError):
            part.clip(len(in_order))
    with pytest.raises(KeyError, match="no split 'nope'"):
        index.split("nope")


# --- the JSON and frame routes -------------------------------------------------------------------
def test_clips_pages_cover_the_split_once_and_filter_by_class(site):
    url, m = site["open"].url, site["manifest"]
    labels = [label for shard in m.splits["train"].shards for label in shard.labels]
    for label in (None, 1):
        seen, page = [], 0
        while True:
            query = f"split=train&per_page=5&page={page}" + ("" if label is None else f"&class={label}")
            status, headers, body = http(url, path=f"/v1/viewer/tiny/clips?{query}")
            assert status == 200 and headers["cache-control"] == "no-store"
            answer = json.loads(body)
            if not answer["clips"]:
                break
            seen += [(c["n"], c["label"], c["key"]) for c in answer["clips"]]
            page += 1
        expect = [n for n, lab in enumerate(labels) if label is None or lab == label]
        assert [n for n, _, _ in seen] == expect and answer["total"] == len(expect)
        assert all(lab == labels[n] for n, lab, _ in seen)
        assert answer["pages"] == page and answer["frames"] == 8 and answer["classes"] == CLASSES


@pytest.mark.parametrize("query, status, says", [
    ("split=train&per_page=0", 400, "per_page"), ("split=train&per_page=201", 400, "per_page"),
    ("split=train&class=3", 400, "class"), ("split=train&class=-1", 400, "class"),
    ("split=train&page=x", 400, "page"), ("split=nope", 404, "no split 'nope'"),
])
def test_clips_page_bad_queries_get_a_clear_4xx(site, query, status, says):
    got, _, body = http(site["open"].url, path=f"/v1/viewer/tiny/clips?{query}")
    assert got == status and says in json.loads(body)["error"]


def test_the_frame_route_serves_the_shards_jpeg_bytes_with_ranges_and_conditionals(site):
    url, tiny = site["open"].url, site["tiny"]
    jpegs = frame_bytes(site, "train", 7)
    clip = ClipIndex(site["manifest"]).split("train").clip(7)
    path = f"/v1/viewer/{tiny.id}/frames/train/7/3"
    status, headers, body = http(url, path=path)
    assert status == 200 and body == jpegs[3] and headers["content-type"] == "image/jpeg"
    etag = headers["etag"]
    assert re.fullmatch(rf'"{clip.shard.sha256}\.\d+"', etag)
    assert headers["cache-control"] == "public, max-age=31536000, immutable"
    assert headers["x-content-type-options"] == "nosniff"
    status, headers, body = http(url, path=path, headers={"If-None-Match": etag})
    assert status == 304 and body == b"" and headers["cache-control"].endswith("immutable")
    status, headers, body = http(url, path=path, headers={"Range": "bytes=2-11"})
    assert status == 206 and body == jpegs[3][2:12]
    assert headers["content-range"] == f"bytes 2-11/{len(jpegs[3])}"
    status, _, body = http(url, path=path, headers={"Range": "bytes=-4", "If-Range": etag})
    assert status == 206 and body == jpegs[3][-4:]
    status, _, body = http(url, path=path, headers={"Range": "bytes=2-11", "If-Range": '"other"'})
    assert status == 200 and body == jpegs[3]
    status, headers, _ = http(url, path=path, headers={"Range": f"bytes={len(jpegs[3])}-"})
    assert status == 416 and headers["content-range"] == f"bytes */{len(jpegs[3])}"
    assert http(url, path=path, headers={"If-Match": '"other"'})[0] == 412
    status, headers, body = http(url, "HEAD", path)
    assert status == 200 and body == b"" and int(headers["content-length"]) == len(jpegs[3])
    status, headers, body = http(url, path="/v1/viewer/prod/frames/train/7/3")  # a tag can move: revalidate
    assert status == 200 and body == jpegs[3] and headers["cache-control"] == "no-cache"


def test_frames_of_a_remote_set_stream_through_the_service(site):
    jpegs = frame_bytes(site, "val", 4)
    for t in (0, 5):
        status, headers, body = http(site["open"].url, path=f"/v1/viewer/{'ab' * 32}/frames/val/4/{t}")
        assert status == 200 and body == jpegs[t] and headers["content-type"] == "image/jpeg"
    status, _, body = http(site["open"].url, path="/v1/viewer/remote/frames/val/4/5",
                           headers={"Range": "bytes=-7"})
    assert status == 206 and body == jpegs[5][-7:]


FRAME_TRAVERSALS = [t.replace(b"/v1/datasets/tiny/", b"/v1/viewer/tiny/frames/") for t in TRAVERSALS]


@pytest.mark.parametrize("raw", FRAME_TRAVERSALS + [
    b"/v1/viewer/tiny/frames/train/24/0", b"/v1/viewer/tiny/frames/train/1/8",
    b"/v1/viewer/tiny/frames/nope/1/0",
    b"/v1/viewer/tiny/frames/train/x/0", b"/v1/viewer/nothing/frames/train/1/0",
    b"/v1/viewer/half/frames/train/1/0",
    b"/sets/tiny/../../secret.txt", b"/static/../viewer.py", b"/static/%2e%2e/viewer.py",
    b"/static/catalog.html",
])
def test_frame_and_page_routes_refuse_traversal_and_unknown_names(site, raw):
    status, _, body = http(site["open"].url, raw_path=raw)
    expect = 409 if b"/half/" in raw else 400 if raw in FRAME_TRAVERSALS or b".." in raw else (400, 404)
    assert status in ((expect,) if isinstance(expect, int) else expect), (status, body)
    assert b"SECRET" not in body and b"\xff\xd8" not in body and b"import" not in body and len(body) < 400


def test_the_start_lines_name_the_viewer_and_the_api_and_both_answer(site):
    """Before: one line, ``serving http://HOST:PORT/v1``, which answered 404; the viewer unmentioned."""
    for server in (site["open"], site["auth"]):
        viewer, api = server.banner
        assert re.fullmatch(r"serving (http://127\.0\.0\.1:\d+/) : the dataset viewer\n", viewer)
        assert re.fullmatch(r" +(http://127\.0\.0\.1:\d+/v1) : the API \(a set's URL: "
                            r"http://\S+/v1/datasets/NAME\); catalog \S+catalog\.sqlite\n", api)
        for url in (viewer.split()[1], api.split()[0]):
            origin, path = re.fullmatch(r"(http://[^/]+)(/.*)", url).groups()
            status, _, body = http(origin, path=path)
            assert status == 200, (url, status, body[:200])
        status, _, body = http(server.url, path="/v1")  # the API's base says where things are, no data
        assert {"method": "GET", "path": "/v1/datasets", "access": "read"} in json.loads(body)["routes"]
        assert b"tiny" not in body


def test_pages_are_static_shells_with_a_strict_policy(site):
    url = site["open"].url
    for path in ("/", "/sets/tiny", "/sets/tiny/clips", "/static/viewer.js", "/static/viewer.css",
                 "/v1/viewer/tiny"):
        status, headers, body = http(url, path=path)
        assert status == 200, path
        csp = headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe" not in csp and "default-src 'none'" in csp
        assert headers["x-content-type-options"] == "nosniff" and headers["referrer-policy"] == "no-referrer"
        if path.startswith("/sets") or path == "/":
            html = body.decode()
            assert b"tiny" not in body and "walking" not in html  # no data in any page
            scripts = re.findall(r"<script([^>]*)>(.*?)</script>", html, re.S)
            assert scripts == [(' src="/static/viewer.js" defer', "")]  # one script, from a file
            assert not re.search(r"\son\w+\s*=|\sstyle\s*=|javascript:", html)
    status, headers, body = http(url, path="/static/viewer.js")
    assert http(url, path="/static/viewer.js", headers={"If-None-Match": headers["etag"]})[0] == 304


def test_read_auth_json_and_frame_routes_need_the_token(site):
    url = site["auth"].url
    status, _, body = http(url, path="/v1/viewer")
    settings = json.loads(body)
    assert status == 200 and settings["read_auth"] is True  # the badges' table: no set's data
    assert set(settings["states"]) == set(STATES) and settings["states"]["damaged"]["tone"] == "bad"
    for path in ("/v1/viewer/tiny", "/v1/viewer/tiny/clips?split=train", "/v1/viewer/tiny/clips/train/1",
                 "/v1/viewer/tiny/frames/train/1/0", "/v1/viewer/tiny/probe"):
        status, _, body = http(url, path=path)
        assert status == 401 and b"tiny" not in body and b"walking" not in body, path
        status, _, body = http(url, path=path, headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200, path
    status, headers, _ = http(url, path=f"/v1/viewer/{site['tiny'].id}/frames/train/1/0",
                              headers={"Authorization": f"Bearer {TOKEN}"})
    assert headers["cache-control"].startswith("private")


def test_motion_route_serves_each_frames_field_coloured_at_the_clips_scale(site):
    """The motion set's fields (uniform: frame t of clip n moved ``frame_motion(n, t)``, rightward
    and growing with t) as pictures of the frame's size, in the optical-flow colours of
    ``shards.format.motioncolour``, one scale for the clip; a set without fields says so."""
    url = site["open"].url
    for n in (1, 4):
        scale = max(math.hypot(*frame_motion(n, t)) for t in range(8))
        blues = []
        for t in (0, 3, 7):
            status, headers, body = http(url, path=f"/v1/viewer/moving/motion/train/{n}/{t}")
            assert status == 200 and headers["content-type"] == "image/png", body[:200]
            picture = np.asarray(Image.open(io.BytesIO(body)).convert("RGB")).astype(int)
            # the frame's size, cells cut at its edge
            assert picture.shape == (MOTION_SIZE[1], MOTION_SIZE[0], 3)
            expect = motioncolour.colour(np.array([[frame_motion(n, t)]]), np.ones((1, 1), bool), scale)[0, 0]
            # stored fields are quantised
            assert np.abs(picture - expect).max() <= 4, (n, t, picture[0, 0], expect)
            assert (picture[..., 0] == 255).all()  # rightward, down a little: red to orange, never blue
            blues.append(int(picture[0, 0, 2]))
        # longer motion, deeper colour; the longest full
        assert blues[0] > blues[1] > blues[2] and blues[2] <= 2
        detail = json.loads(http(url, path=f"/v1/viewer/moving/clips/train/{n}")[2])
        assert detail["motion"] == "mv" and abs(detail["motion_scale"] - scale) < 0.2
    status, headers, _ = http(url, path="/v1/viewer/moving/motion/train/1/3")
    assert http(url, path="/v1/viewer/moving/motion/train/1/3",
                headers={"If-None-Match": headers["etag"]})[0] == 304
    assert headers["cache-control"] == "no-cache"  # drawn here, not stored: asked again each time
    assert json.loads(http(url, path="/v1/viewer/moving/clips?split=train")[2])["motion"] == "mv"
    assert json.loads(http(url, path="/v1/viewer/tiny/clips?split=train")[2])["motion"] is None
    status, _, body = http(url, path="/v1/viewer/tiny/motion/train/1/0")
    assert status == 404 and "no motion fields" in json.loads(body)["error"]
    assert http(url, path="/v1/viewer/moving/motion/train/1/8")[0] == 404
    status, headers, body = http(url, path="/static/motion-legend.png")
    assert status == 200 and headers["content-type"] == "image/png"
    # right red, down yellow, left cyan, up blue, white centre
    wheel = Image.open(io.BytesIO(body)).convert("RGB")
    w = wheel.width
    assert min(wheel.getpixel((w // 2, w // 2))) >= 245  # no motion: white
    right, down, left, up = (wheel.getpixel(xy) for xy in ((w - 3, w // 2), (w // 2, w - 3), (2, w // 2),
                                                           (w // 2, 2)))
    assert right[0] > 200 > right[1] and down[0] > 200 and down[1] > 150 and down[2] < 60
    assert left[0] < 60 and left[2] > 200 and up[2] > 200 and up[1] < 60


# --- in a real browser ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    require("browser", None if shutil.which("chromium") and shutil.which("chromedriver") else
            "Debian's chromium and chromium-driver are not installed (bash scripts/test.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1200,900"):
        options.add_argument(arg)
    options.binary_location = shutil.which("chromium")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    driver.set_script_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()  # stops chromium and chromedriver


def wait(driver, script: str, timeout: float = 60):
    """Until the page's JavaScript ``script`` returns something truthy; returns it."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: d.execute_script(script))


def page(driver, url: str) -> str:
    driver.get(url)
    wait(driver, "return document.body.dataset.ready === '1' || !document.getElementById('login').hidden")
    return driver.execute_script("return document.body.innerText")


def console_errors(driver) -> list:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_browser_catalog_lists_the_set_and_a_build_updating_live(site, browser):
    cat = site["catalog"]  # a build claimed now, its lease alive (this process, a fresh heartbeat) throughout
    building = cat.claim("dd" * 32, source="tests", location=str(site["root"] / "growing"), options={},
                         name="growing")
    cat.set_progress(building.record.id, building.owner, {"videos_done": 3, "videos_total": 10, "failed": 1,
                                                          "shards_written": 2})
    text = page(browser, site["open"].url + "/")
    row = browser.execute_script(f"return "
                                 f"document.querySelector('tr[data-id=\"{site['tiny'].id}\"]').innerText")
    assert "tiny" in row and "ready" in row and "30" in row and "prod" in row
    assert "3 / 10 videos, 1 failed, 2 shards written" in text
    cat.set_progress(building.record.id, building.owner, {"videos_done": 7, "videos_total": 10, "failed": 1,
                                                          "shards_written": 5})
    wait(browser, "return document.body.innerText.includes('7 / 10 videos, 1 failed, 5 shards written')")
    assert browser.execute_script(f"return document.querySelector('tr[data-id=\"{'dd' * 32}\"] "
                                  f"progress').value") == 7
    assert console_errors(browser) == []


def test_a_set_verify_found_bad_is_listed_damaged_shown_and_not_served(site):
    url = site["open"].url
    listed = {d["name"]: d for d in json.loads(http(url, path="/v1/datasets")[2])["datasets"]}
    assert listed["tiny"]["state"] == "ready" and listed["tiny"]["problem"] is None
    worn = listed["worn"]
    assert worn["state"] == "damaged" and WORN in worn["problem"] and "shard-service verify" in worn["remedy"]
    # the data route: not as sound
    assert http(url, path="/v1/datasets/worn/train/train-000000.tar")[0] == 409
    status, _, body = http(url, path="/v1/viewer/worn")  # the viewer shows it, saying what it is
    assert status == 200 and json.loads(body)["record"]["state"] == "damaged"
    status, headers, _ = http(url, path="/v1/viewer/worn/frames/train/0/0")
    assert status == 200 and headers["cache-control"] == "no-store"


BADGES = ("return Array.from(document.querySelectorAll('.badge'), b => [b.closest('tr') ? "
          "b.closest('tr').dataset.id : '', b.dataset.state, b.innerText, "
          "getComputedStyle(b).backgroundColor, b.title])")


def test_browser_a_damaged_set_is_never_green(site, browser):
    """Before: a set verify had found bad was a green ``ready`` in the catalog and on its page. Every
    state has its badge (service.states), and only a sound set's is green."""
    page(browser, site["open"].url + "/")
    badges = browser.execute_script(BADGES)
    shown = {row: (state, text, background, title) for row, state, text, background, title in badges}
    assert shown[site["tiny"].id][:3] == ("ready", "ready", GREEN)
    assert shown["cd" * 32][:2] == ("damaged", "damaged") and shown["cd" * 32][2] == "rgb(176, 0, 32)"  # red
    assert all((background == GREEN) == (state == "ready") for _, state, _, background, _ in badges), badges
    assert {state for _, state, *_ in badges} >= {"ready", "damaged", "building"}
    assert all(title == STATES[state].meaning for _, state, _, _, title in badges)
    cell = browser.execute_script(f"return document.querySelector('tr[data-id=\"{'cd' * 32}\"] "
                                  f"td.state').innerText")
    assert cell.startswith("damaged") and WORN in cell  # why, under the badge
    # its why kept to three lines in the table (the row no taller than that), all of it in the tooltip
    why, title, height, full, line = browser.execute_script(
        f"const w = document.querySelector('tr[data-id=\"{'cd' * 32}\"] td.state .why'); "
        "return [w.textContent, w.title, w.clientHeight, w.scrollHeight, "
        "parseFloat(getComputedStyle(w).lineHeight)]")
    assert title == why and WORN in why and "shard-service verify" in why
    assert height <= 3 * line + 1 < full, (height, full, line)
    # the last verify column narrow: broken between date and time, not inside
    browser.set_window_size(900, 900)
    try:
        verified = browser.execute_script(f"const c = document.querySelector('tr[data-id=\"{'cd' * 32}\"]')"
                                          ".lastChild; return [c.innerText, "
                                          "Array.from(c.querySelectorAll('.nowrap'), s => "
                                          "s.getClientRects().length)]")
    finally:
        browser.set_window_size(1200, 900)  # as the fixture started it
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\S+: 1 problem", verified[0]) and verified[1] == [1, 1], verified
    page(browser, site["open"].url + "/sets/worn")
    dd = browser.execute_script("const d = Array.from(document.querySelectorAll('#record dd'))"
                                ".find(d => d.previousSibling.innerText === 'state'); "
                                "return [d.innerText, "
                                "getComputedStyle(d.querySelector('.badge')).backgroundColor]")
    assert dd == ["damaged", "rgb(176, 0, 32)"]
    assert WORN in browser.execute_script("return document.getElementById('record').innerText")
    assert console_errors(browser) == []


def test_browser_set_page_counts_equal_the_manifest(site, browser):
    m = site["manifest"]
    page(browser, site["open"].url + "/sets/tiny")
    wait(browser, "return document.querySelectorAll('#frames tbody tr').length > 0")  # the probe came back
    rows = browser.execute_script("return Array.from(document.querySelectorAll('#splits tbody tr'))"
                                  ".map(r => Array.from(r.cells).map(c => c.innerText))")
    assert {r[0]: (int(r[1]), int(r[3])) for r in rows} == {
        name: (s.num_samples, len(s.shards)) for name, s in m.splits.items()}
    bars = browser.execute_script("return Array.from(document.querySelectorAll('#histogram rect'))"
                                  ".map(r => r.textContent)")
    counts = Counter(label for shard in m.splits["train"].shards for label in shard.labels)
    assert sorted(bars) == sorted(f"{CLASSES[c]}: {n}" for c, n in counts.items())
    ledger = browser.execute_script("return Array.from(document.querySelectorAll('#errors tbody tr'))"
                                    ".map(r => Array.from(r.cells).map(c => c.innerText))")
    assert ledger == [[e["path"], e["split"], e["reason"], e["ffmpeg"]] for e in site["ledger"]]
    frames = browser.execute_script("return document.querySelector('#frames tbody').innerText")
    assert "8 frames per clip" in frames and "64x48 px: 64 frames" in frames  # before: "8: 8" and "64x48: 64"
    assert console_errors(browser) == []


def test_browser_first_clips_page_shows_the_shards_jpegs(site, browser):
    """Under the page's own policy (nothing set aside): every image of the first clips page shows
    the JPEG its frame URL serves, which is the shard's: its pixels, drawn on a canvas, are
    Pillow's decode of those bytes within the two decoders' rounding, and no other frame of the
    clip is that close."""
    page(browser, site["open"].url + "/sets/tiny/clips?per_page=6")
    wait(browser, "return document.body.dataset.loaded === 'clips'")
    shown = shown_pixels(browser)
    assert len(shown) == 6 * 8
    for url, src, width, height, pixels in shown:
        split, n, t = url.split("/")[-3:]
        jpegs = frame_bytes(site, split, int(n))
        assert src.startswith("blob:") and (width, height) == (64, 48)
        status, _, served = http(site["open"].url, path=url)
        assert status == 200 and served == jpegs[int(t)], url
        seen = np.frombuffer(base64.b64decode(pixels), np.uint8).reshape(height, width, 3).astype(int)
        off = [np.abs(seen - np.asarray(Image.open(io.BytesIO(j)).convert("RGB"), int)).max() for j in jpegs]
        assert off[int(t)] <= 4 and min(o for k, o in enumerate(off) if k != int(t)) > 16, (url, off)
    assert console_errors(browser) == []


def shown_pixels(browser) -> list:
    """(frame URL, src, width, height, base64 of the RGB pixels shown) of every image of the clips grid."""
    return browser.execute_script("""
        return Array.from(document.querySelectorAll('#grid img')).map((img) => {
          const canvas = document.createElement('canvas');
          canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
          const context = canvas.getContext('2d');
          context.drawImage(img, 0, 0);
          const rgba = context.getImageData(0, 0, canvas.width, canvas.height).data;
          let s = '';
          for (let i = 0; i < rgba.length; i += 4) {
            s += String.fromCharCode(rgba[i], rgba[i + 1], rgba[i + 2]);
          }
          return [img.dataset.frame, img.src, canvas.width, canvas.height, btoa(s)];
        });""")


IMAGES = ("return Array.from(document.querySelectorAll(arguments[0]), i => [i.className, i.dataset.frame || "
          "'', i.complete && i.naturalWidth, i.naturalHeight])")


def test_browser_motion_toggle_shows_a_field_per_frame(site, browser):
    """The motion set's clips: frames, motion or both (each field under its frame), and in the
    clip's modal both players side by side; the colour wheel beside them. Before: no motion anywhere."""
    from selenium.webdriver.support.ui import Select

    url = site["open"].url
    page(browser, url + "/sets/moving/clips?view=motion")
    wait(browser, "return document.body.dataset.loaded === 'clips'")
    figures = browser.execute_script("return Array.from(document.querySelectorAll('#grid figure'), f => "
                                     "f.dataset.n)")
    assert len(figures) == 6
    for n in figures:
        shown = browser.execute_script(IMAGES, f"#grid figure[data-n='{n}'] img")
        assert [(cls, src.split("/v1/viewer/")[1].split("/", 1)[1]) for cls, src, _, _ in shown] == \
            [("motion", f"motion/train/{n}/{t}") for t in range(8)]  # an image per frame, frame order
        # loaded, the frames' size
        assert all(w == MOTION_SIZE[0] and h == MOTION_SIZE[1] for _, _, w, h in shown)
    legend = browser.execute_script("const i = document.querySelector('#clips-legend img'); "
                                    "return [i.naturalWidth, "
                                    "document.getElementById('clips-legend').innerText]")
    assert legend[0] > 0 and "direction as hue" in legend[1]
    Select(browser.find_element("id", "view")).select_by_value("both")
    wait(browser, "return document.body.dataset.loaded === 'clips' && location.search.includes('view=both')")
    cells = browser.execute_script("return Array.from(document.querySelectorAll('#grid figure[data-n=\"0\"] "
                                   ".cell'), c => Array.from(c.querySelectorAll('img'), i => i.className + ' "
                                   "' + (i.complete && i.naturalWidth)))")
    assert cells == [["frame 85", "motion 85"]] * 8  # each field under its frame
    browser.find_element("css selector", "#grid figure").click()
    wait(browser, "return document.getElementById('detail').open && "
                  "document.querySelectorAll('#detail-frames img').length === 16 && "
                  "Array.from(document.querySelectorAll('#detail-frames img')).every(i => i.naturalWidth > "
                  "0) && document.getElementById('player-motion').naturalWidth > 0")
    players = browser.execute_script("return ['player', 'player-motion'].map(id => { const r = "
                                     "document.getElementById(id).getBoundingClientRect(); return [r.left, "
                                     "r.top, r.width]; })")
    # side by side
    assert players[0][2] > 0 and players[1][2] > 0 and players[1][0] >= players[0][0] + players[0][2]
    assert "full colour at" in browser.execute_script("return "
                                                      "document.getElementById('detail-fields').innerText")
    browser.execute_script("document.getElementById('detail').close()")
    page(browser, url + "/sets/tiny/clips")  # a set without fields: no toggle, frames only
    wait(browser, "return document.body.dataset.loaded === 'clips'")
    assert browser.execute_script("return document.getElementById('view-label').hidden && "
                                  "document.querySelectorAll('#grid img.motion').length === 0")
    assert console_errors(browser) == []


def test_browser_class_chart_labels_itself_at_400_classes(site, browser):
    """Before: bare bars, names and counts only in tooltips, no axis. Now: axes with their labels
    and ticks, the longest and shortest classes marked and named, every class and its count in
    the table beside the chart, sorted as the bars are."""
    page(browser, site["open"].url + "/sets/many")
    wait(browser, "return document.querySelectorAll('#hist-table tbody tr').length > 0")
    texts = browser.execute_script("return Array.from(document.querySelectorAll('#histogram text'), t => "
                                   "[t.getAttribute('class'), t.textContent])")
    labels = [t for cls, t in texts if cls == "axis-label"]
    assert labels == ["clips", "400 classes, most clips first"]
    ticks = [int(t.replace(",", "")) for cls, t in texts if cls == "tick"]
    assert ticks[0] == 0 and ticks[-1] >= max(MANY_COUNTS) and len(ticks) >= 3
    longest = max(range(400), key=lambda c: (MANY_COUNTS[c], -c))
    shortest = min(range(400), key=lambda c: (MANY_COUNTS[c], -c))
    notes = [t for cls, t in texts if cls.startswith("note")]
    assert notes == [f"longest: {MANY[longest]} ({MANY_COUNTS[longest]})",
                     f"shortest: {MANY[shortest]} ({MANY_COUNTS[shortest]})"]
    bars = browser.execute_script("return Array.from(document.querySelectorAll('#histogram rect'), r => "
                                  "[Number(r.dataset.class), r.getAttribute('class'), "
                                  "Number(r.getAttribute('height'))])")
    assert len(bars) == 400 and [b[0] for b in bars] == sorted(range(400), key=lambda c: (-MANY_COUNTS[c], c))
    assert bars[0][1] == "longest" and bars[-1][1] == "shortest" and bars[0][2] > bars[-1][2] > 0
    rows = browser.execute_script("return Array.from(document.querySelectorAll('#hist-table tbody tr'), r => "
                                  "Array.from(r.cells, c => c.innerText))")
    assert [(name, int(n)) for _, name, n, _ in rows] == [(MANY[c], MANY_COUNTS[c]) for c, _, _ in bars]
    assert browser.execute_script("return document.getElementById('hist-summary').innerText") == \
        f"{sum(MANY_COUNTS):,} clips in 400 classes"
    page(browser, site["open"].url + "/sets/tiny")  # every class alike: nothing to mark
    wait(browser, "return document.querySelectorAll('#hist-table tbody tr').length > 0")
    assert browser.execute_script("return Array.from(document.querySelectorAll('#histogram .note'), t => "
                                  "t.textContent)") == ["every class: 8 clips"]
    assert console_errors(browser) == []


def test_browser_class_filter_and_detail_view(site, browser):
    from selenium.webdriver.support.ui import Select

    page(browser, site["open"].url + "/sets/tiny/clips")
    wait(browser, "return document.body.dataset.loaded === 'clips'")
    Select(browser.find_element("id", "class")).select_by_value("2")
    wait(browser, "return document.body.dataset.loaded === 'clips' && location.search.includes('class=2')")
    labels = browser.execute_script("return Array.from(document.querySelectorAll('#grid figure'))"
                                    ".map(f => f.dataset.label + ' ' + "
                                    "f.querySelector('figcaption').innerText)")
    expect = [n for n, label in enumerate(ClipIndex(site["manifest"]).split("train").labels) if label == 2]
    assert labels and len(labels) == len(expect) and all(x.startswith("2 jumping") for x in labels)
    browser.find_element("css selector", "#grid figure").click()
    wait(browser, "return document.getElementById('detail').open && "
                  "Array.from(document.querySelectorAll('#detail-frames img'))"
                  ".every(i => i.naturalWidth > 0)")
    detail = browser.execute_script("return document.getElementById('detail').innerText")
    clip = ClipIndex(site["manifest"]).split("train").clip(expect[0])
    assert clip.key in detail and f"videos/{clip.key[:-4]}.mp4" in detail and f"{clip.offset:,}" in detail
    wait(browser, "return document.getElementById('player').dataset.frame.endsWith('/1')")  # the loop plays
    assert console_errors(browser) == []


def test_browser_a_hostile_class_name_is_text_and_runs_nothing(site, browser):
    ran = "return document.querySelectorAll('img[src=\"x\"], script:not([src])').length"
    for path in ("/sets/tiny", "/sets/tiny/clips?class=1"):
        page(browser, site["open"].url + path)
        text = wait(browser, f"return document.body.innerText.includes({json.dumps(HOSTILE)}) && "
                             "document.body.innerText")
        assert browser.execute_script(ran) == 0
        assert browser.execute_script("return window.pwned === undefined")
        if path == "/sets/tiny":
            assert HOSTILE_MESSAGE in text
    wait(browser, "return document.body.dataset.loaded === 'clips'")
    browser.find_element("css selector", "#grid figure").click()  # the clip's modal: its title and fields
    title = wait(browser, "return document.getElementById('detail').open && "
                          "document.getElementById('detail-title').innerText")
    assert title.startswith(HOSTILE) and HOSTILE in browser.execute_script(
        "return document.getElementById('detail-fields').innerText")
    assert browser.execute_script(ran) == 0 and browser.execute_script("return window.pwned === undefined")
    assert console_errors(browser) == []


def test_browser_read_auth_shows_nothing_before_the_token(site, browser):
    url = site["auth"].url
    browser.get(url + "/")  # a fresh origin: no token in this tab's storage
    for path in ("/", "/sets/tiny", "/sets/tiny/clips"):
        text = page(browser, url + path)
        assert browser.execute_script("return !document.getElementById('login').hidden && "
                                      "document.getElementById('main').hidden")
        assert not any(word in text for word in ("tiny", "walking", "jumping", "train_v", "prod"))
        asked = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert {a.removeprefix(url) for a in asked} <= {"/static/viewer.css", "/static/viewer.js",
                                                        "/static/icon.svg", "/v1/viewer"}, asked
        assert browser.execute_script("return document.images.length === 0 || "
                                      "Array.from(document.images).every(i => !i.src)")
    browser.find_element("id", "token").send_keys(TOKEN)
    browser.find_element("css selector", "#login button").click()
    wait(browser, "return document.body.dataset.loaded === 'clips'")
    assert TOKEN not in browser.current_url and "token" not in browser.current_url
    widths = browser.execute_script("return Array.from(document.querySelectorAll('#grid img'), i => "
                                    "i.naturalWidth)")
    assert widths and all(w == 64 for w in widths)
    asked = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert not any(TOKEN in a for a in asked)
    page(browser, url + "/")  # asked once: the next page opens with the token
    wait(browser, "return document.body.innerText.includes('tiny')")
    browser.execute_script("sessionStorage.clear()")
    assert console_errors(browser) == []


# --- shards preview ------------------------------------------------------------------------------
def test_preview_contact_sheet_from_a_path_and_from_the_service(site, tmp_path):
    m = site["manifest"]
    for source in (str(site["root"] / "tiny"), site["open"].url + "/v1/datasets/tiny"):
        out = tmp_path / "sheet.png"
        subprocess.run([sys.executable, "-m", "shards", "preview", source, "--split", "train",
                        "--classes", "jumping", "walking", "--clips", "4", "--height", "48",
                        "--out", str(out), "--html", str(tmp_path / "h")],
                       check=True, capture_output=True)
        sheet = Image.open(out).convert("RGB")
        labels = ClipIndex(m).split("train").labels
        chosen = [n for n, label in enumerate(labels) if label in (0, 2)]
        chosen = [chosen[k] for k in (0, 5, 10, 15)]  # spread evenly over the 16 matching clips
        assert sheet.height == 4 * (48 + 4) + 4
        for row, n in enumerate(chosen):
            for t in (0, 7):  # the centre of frame t in row r is the clip's frame colour
                x, y = 240 + t * (64 + 4) + 32, 4 + row * (48 + 4) + 24
                assert max(abs(a - b) for a, b in zip(sheet.getpixel((x, y)), frame_colour(n, t))) <= 6
        html = (tmp_path / "h" / "index.html").read_text()
        assert "jumping" in html and "walking" in html and "<img src=x" not in html
        assert (tmp_path / "h" / "frames"
                / "0001_03.jpg").read_bytes() == frame_bytes(site, "train", chosen[1])[3]


def test_preview_escapes_names_and_says_what_is_wrong(site, tmp_path):
    tiny = str(site["root"] / "tiny")
    run = lambda *a: subprocess.run([sys.executable, "-m", "shards", "preview", tiny, *a],  # noqa: E731
                                    capture_output=True, text=True)
    done = run("--split", "train", "--classes", HOSTILE, "--clips", "2", "--html", str(tmp_path / "h"))
    assert done.returncode == 0, done.stderr
    html = (tmp_path / "h" / "index.html").read_text()
    assert HOSTILE not in html and "&lt;img src=x onerror=&quot;window.pwned=1&quot;&gt;" in html
    for args, says in ((["--split", "nope", "--out", "x.png"], "no split 'nope'"),
                       (["--classes", "dancing", "--out", "x.png"], "no class 'dancing'"),
                       (["--split", "train"], "give --out")):
        done = run(*args)
        assert done.returncode != 0 and says in done.stderr and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
