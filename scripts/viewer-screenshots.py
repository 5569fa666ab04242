"""Screenshots of the dataset viewer's pages for the docs (docs/viewer-*.png), and a contact
sheet with motion fields (docs/preview-motion.png).

Generates a small motion dataset (``ingest synth``, plus two broken files for the error
ledger), builds it into a catalog with motion vectors (``ingest build --catalog --motion mv``),
builds it again with 4 frames a clip and damages a shard of that one (``shard-service verify``
records the problems), adds a 400-class set (the test helpers' ``make_class_set``: one frame a
clip), serves the catalog, asks the server for a third, larger build over HTTP so that the
catalog page shows one in progress, and photographs in headless chromium: the catalog (every
state's badge), the set page, the 400-class chart, the clips page with frames and motion, and
a clip's player. The PNGs are reduced to 256 colours to stay small.

    .venv/bin/python scripts/viewer-screenshots.py [--work /tmp/kf-viewer-shots] [--out docs]

Needs the dev extras (Selenium) and Debian's chromium and chromium-driver (scripts/test.sh
installs them).
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import urllib.request

from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait

BIN = os.path.dirname(sys.executable)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # the server's Ray on 127.0.0.1


def shoot(driver, url: str, ready: str, path: str) -> None:
    """The whole page once ``ready`` (JavaScript) is true, as a PNG of 256 colours."""
    driver.get(url)
    WebDriverWait(driver, 120).until(lambda d: d.execute_script(ready))
    size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True,
                                                             "clip": {
        "x": 0, "y": 0, "width": size["width"], "height": max(size["height"], 600), "scale": 1}})
    image = Image.open(io.BytesIO(base64.b64decode(shot["data"]))).convert("RGB")
    image.quantize(256, method=Image.Quantize.FASTOCTREE).save(path, optimize=True)
    print(f"{path}: {os.path.getsize(path) / 1e3:.0f} kB")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/kf-viewer-shots", help="working directory (its videos are reused)")
    p.add_argument("--out", default="docs", help="where the PNGs go")
    args = p.parse_args()
    # kept: synth skips what is there
    src, big = os.path.join(args.work, "src"), os.path.join(args.work, "big")
    shutil.rmtree(os.path.join(args.work, "sets"), ignore_errors=True)
    for name in ("catalog.sqlite", "catalog.sqlite-wal", "catalog.sqlite-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(args.work, name))
    run = lambda *a: subprocess.run(a, check=True)  # noqa: E731
    run(f"{BIN}/ingest", "synth", "--out", src, "--classes", "4", "--train-per-class", "12",
        "--val-per-class", "4", "--width", "96", "--height", "96", "--fps", "10", "--seconds", "2")
    left = os.path.join(src, "train", "move_left")
    with open(os.path.join(left, sorted(os.listdir(left))[0]), "rb") as f:
        head = f.read(2000)
    with open(os.path.join(left, "truncated.mp4"), "wb") as f:
        f.write(head)
    with open(os.path.join(src, "val", "move_up", "notes.mp4"), "w") as f:
        f.write("not a video\n")
    catalog = os.path.join(args.work, "catalog.sqlite")
    run(f"{BIN}/ingest", "build", "--src", src, "--out", os.path.join(args.work, "sets", "motion4"),
        "--frames", "8", "--short-side", "96", "--shard-samples", "16", "--catalog", catalog,
        "--name", "motion4", "--workers", "2", "--motion", "mv")
    worn = os.path.join(args.work, "sets", "motion4-f4")
    run(f"{BIN}/ingest", "build", "--src", src, "--out", worn, "--frames", "4", "--short-side", "64",
        "--shard-samples", "16", "--catalog", catalog, "--name", "motion4-f4", "--workers", "2")
    # a flipped byte, as bit rot would
    with open(os.path.join(worn, "train", "train-000000.tar"), "r+b") as f:
        f.seek(3000)
        byte = f.read(1)
        f.seek(3000)
        f.write(bytes([byte[0] ^ 0x10]))
    subprocess.run([f"{BIN}/shard-service", "verify", "motion4-f4", "--catalog", catalog])  # exit 1: problems
    from shardsets import make_class_set, register

    from shards.catalog import Catalog

    many = [f"{verb} {thing}" for verb in ("riding", "playing", "making", "cleaning", "throwing", "climbing",
                                           "washing", "juggling", "carving", "folding")
            for thing in ("a bike", "the drums", "tea", "windows", "a ball", "a rope", "dishes", "clubs",
                          "pumpkins", "paper", "a kite", "bread", "shoes", "a guitar", "ice", "a horse",
                          "snow", "a cake", "laundry", "a fence", "sand", "a boat", "cards", "a tree", "hair",
                          "a car", "the floor", "a door", "a wall", "a tent", "cheese", "a dog", "a cat",
                          "fish", "eggs", "wood", "glass", "a sail", "a net", "a wheel")]
    # a long tail, as Kinetics has
    counts = [max(4, round(40 * 0.9996 ** (c * c / 8))) for c in range(len(many))]
    make_class_set(os.path.join(args.work, "sets", "kinetics-like"), counts, many)
    register(Catalog(catalog), os.path.join(args.work, "sets", "kinetics-like"), "kinetics-like")
    run(f"{BIN}/ingest", "synth", "--out", big, "--classes", "6", "--train-per-class", "40",
        "--val-per-class", "0", "--width", "96", "--height", "96", "--fps", "10", "--seconds", "2")
    with open(os.path.join(args.work, "tokens"), "w") as f:
        f.write("screenshots\n")
    server = subprocess.Popen([f"{BIN}/shard-service", "serve", "--catalog", catalog, "--port", "0",
                               "--token-file", os.path.join(args.work, "tokens"), "--source-root", args.work],
                              stdout=subprocess.PIPE, text=True)
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1100,800",
                "--hide-scrollbars"):
        options.add_argument(arg)
    options.binary_location = shutil.which("chromium")
    driver = None
    try:
        url = server.stdout.readline().split()[1].rstrip("/")  # the viewer's URL (the API's is the next line)
        body = json.dumps({"src": big, "name": "motion6", "frames": 8, "short_side": 96,
                           "workers": 1}).encode()
        urllib.request.urlopen(urllib.request.Request(url + "/v1/builds", body, method="POST", headers={
            "Authorization": "Bearer screenshots", "Content-Type": "application/json"}))
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
        os.makedirs(args.out, exist_ok=True)
        shoot(driver, url + "/", "return document.querySelector('progress') && "
              "document.querySelector('progress').value > 0", os.path.join(args.out, "viewer-catalog.png"))
        shoot(driver, url + "/sets/motion4",
              "return document.querySelectorAll('#frames tbody tr').length > 0",
              os.path.join(args.out, "viewer-set.png"))
        shoot(driver, url + "/sets/kinetics-like", "return document.querySelectorAll('#frames tbody "
                                                   "tr').length > 0",
              os.path.join(args.out, "viewer-classes.png"))
        shoot(driver, url + "/sets/motion4/clips?split=train&per_page=6&view=both",
              "return document.body.dataset.loaded === 'clips'", os.path.join(args.out, "viewer-clips.png"))
        shoot(driver, url + "/sets/motion4/clips?split=train&per_page=6&view=both",
              "if (document.body.dataset.loaded === 'clips' && !document.getElementById('detail').open) "
              "document.querySelector('#grid figure').click(); "
              "return document.getElementById('detail').open && "
              "document.getElementById('player-motion').naturalWidth > 0 && "
              "Array.from(document.querySelectorAll('#detail-frames img')).every(i => i.naturalWidth > 0) && "
              "!document.getElementById('play').click() && true", os.path.join(args.out, "viewer-clip.png"))
    finally:
        if driver:
            driver.quit()
        server.terminate()
        server.wait()
    sheet = os.path.join(args.out, "preview-motion.png")
    run(f"{BIN}/shards", "preview", os.path.join(args.work, "sets", "motion4"), "--split", "val",
        "--clips", "4", "--height", "64", "--out", sheet)
    Image.open(sheet).convert("RGB").quantize(256,
                                              method=Image.Quantize.FASTOCTREE).save(sheet, optimize=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
