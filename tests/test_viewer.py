"""The dataset viewer (service/viewer.py, service/static/) against the real server on loopback:
its JSON and frame routes over raw HTTP, and its pages in Debian's headless chromium driven by
Selenium (the catalog, counts on the set page, every frame of the first clips page byte-equal to
the shard's JPEG, the class filter, the detail view, a hostile class name shown as text, no
console errors, and with --read-auth nothing before the token). Also ``shards.clipindex`` and
``shards preview``."""
from __future__ import annotations

import base64
import contextlib
import json
import re
import shutil
import subprocess
import sys
from collections import Counter

import pytest
from PIL import Image

from shards.catalog import Catalog
from shards.clipindex import ClipIndex
from shards.manifest import Manifest
from shards.tarformat import read_members
from shardsets import ServiceProcess, frame_colour, http, make_shardset, register, serve
from test_service import TRAVERSALS

TOKEN = "viewer-token-for-tests"
HOSTILE = '<img src=x onerror="window.pwned=1">'  # a class folder name
HOSTILE_MESSAGE = "<script>window.pwned=2</script> moov atom not found"
CLASSES = ["walking", HOSTILE, "jumping"]
WORN = "train/train-000000.tar: SHA-256 differs from the manifest"  # what verify recorded of the worn set
GREEN = "rgb(19, 115, 51)"  # .state-ready


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("viewer")
    make_shardset(str(root / "tiny"), {"train": 24, "val": 6}, per_shard=6, classes=CLASSES)
    ledger = [{"path": f"train/{HOSTILE}/bad.mp4", "split": "train", "reason": "not a video",
               "ffmpeg": HOSTILE_MESSAGE}, {"path": "val/walking/empty.mp4", "split": "val", "reason": "empty file",
                                            "ffmpeg": ""}]
    (root / "tiny" / "errors.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ledger))
    (root / "secret.txt").write_text("SECRET-BYTES-OUTSIDE-EVERY-SET")
    cat = Catalog(str(root / "catalog.sqlite"))
    tiny = register(cat, str(root / "tiny"), "tiny")
    cat.tag(tiny.id, "prod")
    make_shardset(str(root / "worn"), {"train": 6}, per_shard=6)  # a set `shard-service verify` found bad
    worn = register(cat, str(root / "worn"), "worn", dataset_id="cd" * 32)
    cat.record_verify(worn.id, 1, WORN, cat.get(worn.id).verified_files)
    cat.claim("ee" * 32, source="tests", location=str(root / "half"), options={}, name="half")  # never ready
    (root / "tokens").write_text(TOKEN + "\n")
    stack = contextlib.ExitStack()
    base, _ = stack.enter_context(serve(str(root)))  # the same set on another HTTP server: a remote set
    register(cat, f"{base}/tiny", "remote", dataset_id="ab" * 32)
    servers = {"open": ServiceProcess("--catalog", str(root / "catalog.sqlite")),
               "auth": ServiceProcess("--catalog", str(root / "catalog.sqlite"), "--read-auth", "--token-file",
                                      str(root / "tokens"))}
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
    return [v for name, v in read_members(data) if name.endswith(".jpg")]


# --- shards.clipindex ----------------------------------------------------------------------------
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
    status, _, body = http(site["open"].url, path="/v1/viewer/remote/frames/val/4/5", headers={"Range": "bytes=-7"})
    assert status == 206 and body == jpegs[5][-7:]


FRAME_TRAVERSALS = [t.replace(b"/v1/datasets/tiny/", b"/v1/viewer/tiny/frames/") for t in TRAVERSALS]


@pytest.mark.parametrize("raw", FRAME_TRAVERSALS + [
    b"/v1/viewer/tiny/frames/train/24/0", b"/v1/viewer/tiny/frames/train/1/8", b"/v1/viewer/tiny/frames/nope/1/0",
    b"/v1/viewer/tiny/frames/train/x/0", b"/v1/viewer/nothing/frames/train/1/0", b"/v1/viewer/half/frames/train/1/0",
    b"/sets/tiny/../../secret.txt", b"/static/../viewer.py", b"/static/%2e%2e/viewer.py", b"/static/catalog.html",
])
def test_frame_and_page_routes_refuse_traversal_and_unknown_names(site, raw):
    status, _, body = http(site["open"].url, raw_path=raw)
    expect = 409 if b"/half/" in raw else 400 if raw in FRAME_TRAVERSALS or b".." in raw else (400, 404)
    assert status in ((expect,) if isinstance(expect, int) else expect), (status, body)
    assert b"SECRET" not in body and b"\xff\xd8" not in body and b"import" not in body and len(body) < 400


def test_pages_are_static_shells_with_a_strict_policy(site):
    url = site["open"].url
    for path in ("/", "/sets/tiny", "/sets/tiny/clips", "/static/viewer.js", "/static/viewer.css", "/v1/viewer/tiny"):
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
    assert status == 200 and json.loads(body) == {"read_auth": True}
    for path in ("/v1/viewer/tiny", "/v1/viewer/tiny/clips?split=train", "/v1/viewer/tiny/clips/train/1",
                 "/v1/viewer/tiny/frames/train/1/0", "/v1/viewer/tiny/probe"):
        status, _, body = http(url, path=path)
        assert status == 401 and b"tiny" not in body and b"walking" not in body, path
        status, _, body = http(url, path=path, headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200, path
    status, headers, _ = http(url, path=f"/v1/viewer/{site['tiny'].id}/frames/train/1/0",
                              headers={"Authorization": f"Bearer {TOKEN}"})
    assert headers["cache-control"].startswith("private")


# --- in a real browser ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("Debian's chromium and chromium-driver are not installed (bash scripts/test.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,900"):
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
    building = cat.claim("dd" * 32, source="tests", location=str(site["root"] / "growing"), options={}, name="growing")
    cat.set_progress(building.record.id, building.owner, {"videos_done": 3, "videos_total": 10, "failed": 1,
                                                          "shards_written": 2})
    text = page(browser, site["open"].url + "/")
    row = browser.execute_script(f"return document.querySelector('tr[data-id=\"{site['tiny'].id}\"]').innerText")
    assert "tiny" in row and "ready" in row and "30" in row and "prod" in row
    assert "3 / 10 videos, 1 failed, 2 shards written" in text
    cat.set_progress(building.record.id, building.owner, {"videos_done": 7, "videos_total": 10, "failed": 1,
                                                          "shards_written": 5})
    wait(browser, "return document.body.innerText.includes('7 / 10 videos, 1 failed, 5 shards written')")
    assert browser.execute_script(f"return document.querySelector('tr[data-id=\"{'dd' * 32}\"] progress').value") == 7
    assert console_errors(browser) == []


def test_a_set_verify_found_bad_is_listed_damaged_shown_and_not_served(site):
    url = site["open"].url
    listed = {d["name"]: d for d in json.loads(http(url, path="/v1/datasets")[2])["datasets"]}
    assert listed["tiny"]["state"] == "ready" and listed["tiny"]["problem"] is None
    worn = listed["worn"]
    assert worn["state"] == "damaged" and WORN in worn["problem"] and "shard-service verify" in worn["remedy"]
    assert http(url, path="/v1/datasets/worn/train/train-000000.tar")[0] == 409  # the data route: not as sound
    status, _, body = http(url, path="/v1/viewer/worn")  # the viewer shows it, saying what it is
    assert status == 200 and json.loads(body)["record"]["state"] == "damaged"
    status, headers, _ = http(url, path="/v1/viewer/worn/frames/train/0/0")
    assert status == 200 and headers["cache-control"] == "no-store"


def test_browser_a_damaged_set_is_never_green(site, browser):
    """Before: a set verify had found bad was a green ``ready`` in the catalog and on its page."""
    page(browser, site["open"].url + "/")
    cell = "document.querySelector('tr[data-id=\"" + "cd" * 32 + "\"] td:nth-child(3)')"
    state, colour = browser.execute_script(f"const c = {cell}; return [c.innerText, getComputedStyle(c).color]")
    assert state.startswith("damaged") and WORN in state and colour not in (GREEN, "")
    tiny = browser.execute_script(f"return getComputedStyle({cell.replace('cd' * 32, site['tiny'].id)}).color")
    assert tiny == GREEN  # the sound set beside it
    page(browser, site["open"].url + "/sets/worn")
    shown = browser.execute_script("const d = Array.from(document.querySelectorAll('#record dd'))"
                                   ".find(d => d.previousSibling.innerText === 'state'); "
                                   "return [d.innerText, getComputedStyle(d).color]")
    assert shown[0] == "damaged" and shown[1] not in (GREEN, "")
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
    assert "64x48" in frames and "8: 8" in frames
    assert console_errors(browser) == []


def test_browser_first_clips_page_shows_the_shards_jpegs(site, browser):
    # Reading an image's blob: URL back needs a fetch the page's policy refuses (connect-src 'self'):
    # the policy is set aside for this page only, and the bytes each image shows are read back.
    browser.execute_cdp_cmd("Page.setBypassCSP", {"enabled": True})
    try:
        page(browser, site["open"].url + "/sets/tiny/clips?per_page=6")
        wait(browser, "return document.body.dataset.loaded === 'clips'")
        shown = read_images(browser)
    finally:
        browser.execute_cdp_cmd("Page.setBypassCSP", {"enabled": False})
    assert len(shown) == 6 * 8
    for url, src, width, data in shown:
        split, n, t = url.split("/")[-3:]
        assert src.startswith("blob:") and width == 64
        assert base64.b64decode(data) == frame_bytes(site, split, int(n))[int(t)], url
    assert console_errors(browser) == []


def read_images(browser) -> list:
    """(frame URL, src, natural width, base64 of the bytes shown) of every image of the clips grid."""
    return browser.execute_async_script("""
        const done = arguments[arguments.length - 1];
        Promise.all(Array.from(document.querySelectorAll('#grid img')).map(async (img) => {
          const buf = new Uint8Array(await (await fetch(img.src)).arrayBuffer());
          let s = ''; for (const b of buf) s += String.fromCharCode(b);
          return [img.dataset.frame, img.src, img.complete && img.naturalWidth, btoa(s)];
        })).then(done, (e) => done(String(e)));""")


def test_browser_class_filter_and_detail_view(site, browser):
    from selenium.webdriver.support.ui import Select

    page(browser, site["open"].url + "/sets/tiny/clips")
    wait(browser, "return document.body.dataset.loaded === 'clips'")
    Select(browser.find_element("id", "class")).select_by_value("2")
    wait(browser, "return document.body.dataset.loaded === 'clips' && location.search.includes('class=2')")
    labels = browser.execute_script("return Array.from(document.querySelectorAll('#grid figure'))"
                                    ".map(f => f.dataset.label + ' ' + f.querySelector('figcaption').innerText)")
    expect = [n for n, label in enumerate(ClipIndex(site["manifest"]).split("train").labels) if label == 2]
    assert labels and len(labels) == len(expect) and all(x.startswith("2 jumping") for x in labels)
    browser.find_element("css selector", "#grid figure").click()
    wait(browser, "return document.getElementById('detail').open && "
                  "Array.from(document.querySelectorAll('#detail-frames img')).every(i => i.naturalWidth > 0)")
    detail = browser.execute_script("return document.getElementById('detail').innerText")
    clip = ClipIndex(site["manifest"]).split("train").clip(expect[0])
    assert clip.key in detail and f"videos/{clip.key[:-4]}.mp4" in detail and f"{clip.offset:,}" in detail
    wait(browser, "return document.getElementById('player').dataset.frame.endsWith('/1')")  # the loop plays
    assert console_errors(browser) == []


def test_browser_a_hostile_class_name_is_text_and_runs_nothing(site, browser):
    for path in ("/sets/tiny", "/sets/tiny/clips?class=1"):
        page(browser, site["open"].url + path)
        text = wait(browser, f"return document.body.innerText.includes({json.dumps(HOSTILE)}) && "
                             "document.body.innerText")
        ran = "return document.querySelectorAll('img[src=\"x\"], script:not([src])').length"
        assert browser.execute_script(ran) == 0
        assert browser.execute_script("return window.pwned === undefined")
        if path == "/sets/tiny":
            assert HOSTILE_MESSAGE in text
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
        assert {a.removeprefix(url) for a in asked} <= {"/static/viewer.css", "/static/viewer.js", "/static/icon.svg",
                                                       "/v1/viewer"}, asked
        assert browser.execute_script("return document.images.length === 0 || "
                                      "Array.from(document.images).every(i => !i.src)")
    browser.find_element("id", "token").send_keys(TOKEN)
    browser.find_element("css selector", "#login button").click()
    wait(browser, "return document.body.dataset.loaded === 'clips'")
    assert TOKEN not in browser.current_url and "token" not in browser.current_url
    widths = browser.execute_script("return Array.from(document.querySelectorAll('#grid img'), i => i.naturalWidth)")
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
        subprocess.run([sys.executable, "-m", "shards", "preview", source, "--split", "train", "--classes", "jumping",
                        "walking", "--clips", "4", "--height", "48", "--out", str(out), "--html", str(tmp_path / "h")],
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
        assert (tmp_path / "h" / "frames" / "0001_03.jpg").read_bytes() == frame_bytes(site, "train", chosen[1])[3]


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
