"""The first hour: a newcomer's mistakes on the command line, each answered by one line.

A table of mistakes, each run as the console command a user types (a subprocess, all of them
started at once by one module fixture: most fail before any work). Each must exit with its
documented status (2: the command line asks for something that cannot be done; 1: the work
could not go on; 75: a source that stayed unreachable, try again later), print one ``PROG COMMAND: error:
...`` line on stderr naming the thing and the reason, and no traceback anywhere (under horovodrun, on two
simulated nodes: each rank). The commands that destroyed work silently get their own tests below: a build over
``--max-error-fraction`` registered ``ready`` and reused, ``shards reshard`` into an old set,
``shard-service`` creating a catalog on a typo, training again into an earlier run's directory (its checkpoint
replaced, its metrics appended to).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import media
from helpers.shardsets import ServiceProcess, corrupt_sample, make_shardset, register

from ingest import registry
from ingest.clips import ClipConfig
from shards.catalog import Catalog

TOKEN = "newcomer-token"
FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "checkpoint-v0")  # a checkpoint and its set
BIN = os.path.dirname(sys.executable)  # the console scripts beside this Python


def _free_port() -> int:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# a Python where PyTorch cannot be imported (the ``noextras`` hook below)
NO_TORCH = {"PYTHONPATH": "{noextras}:{pythonpath}", "KF_MISSING_MODULES": "torch"}
# (id, command line, extra environment, exit status, words the error line must hold)
CASES = [
    ("frames-0", "ingest build --src {vids} --out {out} --frames 0", {}, 2, ["--frames", "0", "range"]),
    ("short-side-negative", "ingest build --src {vids} --out {out} --short-side -5", {}, 2,
     ["--short-side", "-5"]),
    ("quality-150", "ingest build --src {vids} --out {out} --quality 150", {}, 2,
     ["--quality", "150", "1 to 100"]),
    ("splits-typo", "ingest build --src {vids} --out {out} --splits train,vall", {}, 2,
     ["--splits", "'vall'"]),
    ("shard-size-unit", "ingest build --src {vids} --out {out} --shard-size 64XB", {}, 2,
     ["--shard-size", "64XB"]),
    ("src-typo", "ingest build --src {root}/kinetcs400/ --out {out}", {}, 2,
     ["kinetcs400", "no such directory"]),
    ("src-empty", "ingest build --src {root}/empty --out {out}", {}, 2, ["empty", "the directory is empty"]),
    ("src-flat", "ingest build --src {root}/flat --out {out}", {}, 2,
     ["flat", "2 directly in it", "flat/train/<label>/<id>.mp4"]),
    ("ray-not-there", "ingest build --src {vids} --out {out} --address 127.0.0.1:{port}",
     {}, 1, ["--address 127.0.0.1:{port}", "nothing answers", "ray start --head"]),
    ("stats-missing", "shards stats {root}/nope", {}, 2, ["nope", "no such file or directory"]),
    ("verify-missing", "shards verify {root}/nope", {}, 2, ["nope", "no such file or directory"]),
    ("plan-missing", "shards plan {root}/nope", {}, 2, ["nope", "no such file or directory"]),
    ("stats-not-a-set", "shards stats {root}/empty", {}, 2, ["empty/manifest.json", "no manifest"]),
    ("plan-no-such-split", "shards plan {set} --split test", {}, 2, ["'test'", "no split"]),
    ("plan-world-size-0", "shards plan {set} --world-sizes 1,0", {}, 2,
     ["--world-sizes", "'1,0'", "1 rank or more"]),
    ("reshard-size-unit", "shards reshard {set} {root}/new --shard-size 64XB", {}, 2,
     ["--shard-size", "64XB"]),
    ("reshard-into-a-set", "shards reshard {set} {old} --num-shards 2", {}, 2, ["old", "not empty"]),
    ("dataset-not-served", "shards stats {url}/v1/datasets/nope", {"FSSPEC_HTTP_HEADERS": "{auth}"}, 2,
     ["/v1/datasets/nope", "HTTP 404", "no dataset 'nope'"]),
    ("read-without-token", "shards verify {url}/v1/datasets/tiny", {}, 1,
     ["/v1/datasets/tiny", "HTTP 401", "FSSPEC_HTTP_HEADERS", "Bearer TOKEN"]),
    ("catalog-typo", "shard-service list --catalog {root}/typo.sqlite", {}, 2,
     ["typo.sqlite", "no such catalog"]),
    ("gc-catalog-typo", "shard-service gc --yes --catalog {root}/typo.sqlite", {}, 2,
     ["typo.sqlite", "no such catalog"]),
    ("dataset-not-in-catalog", "shard-service show nope --catalog {catalog}", {}, 2,
     ["'nope'", "no dataset"]),
    ("segments-not-in-clips",
     "trainer train --data {set} --output-dir {root}/run --backend none --segments 16", {}, 2,
     ["--segments 16", "8 frames"]),
    ("depth-11", "trainer train --data {set} --depth 11", {}, 2, ["--depth", "11", "choose from 10, 18"]),
    # flags that contradict each other are refused before PyTorch loads (NO_TORCH: where it cannot)
    ("tsm-without-its-shift",
     "trainer train --data {set} --output-dir {root}/run --backend none --arch tsm --no-shift",
     NO_TORCH, 2, ["--no-shift", "not with --arch tsm", "--arch tsn"]),
    ("i3d-without-bottlenecks",
     "trainer train --data {set} --output-dir {root}/run --backend none --arch i3d-3x1x1 "
     "--depth 18", NO_TORCH, 2, ["--arch i3d-3x1x1", "--depth 50, 101 or 152, not 18"]),
    ("batch-size-0", "trainer train --data {set} --batch-size 0", {}, 2, ["--batch-size", "0", "range"]),
    ("push-gateway-not-a-url", "trainer train --data {set} --push-gateway pushgateway:9091", {}, 2,
     ["--push-gateway", "'pushgateway:9091' is not an http:// or https:// URL with a host"]),
    ("segments-0", "trainer train --data {set} --segments 0", {}, 2, ["--segments", "0", "range"]),
    ("scale-below-crop", "trainer train --data {set} --crop-size 128 --scale-size 64", NO_TORCH, 2,
     ["--scale-size 64", "smaller than --crop-size 128", "--val-split ''"]),
    ("plot-no-run", "trainer plot {root}/runs/nope", NO_TORCH, 2, ["runs/nope", "no such run"]),
    ("test-without-a-run", "trainer test --data {set}", NO_TORCH, 2,
     ["give either --checkpoint or --fuse RUN_A RUN_B"]),
    ("test-fuse-weights", "trainer test --data {set} --fuse {root}/a {root}/b --weights 1", NO_TORCH, 2,
     ["--weights: one per --fuse run (2), not all zero; got 1.0"]),
    ("test-split-missing",
     f"trainer test --checkpoint {FIXTURE}/checkpoint.pt --data {FIXTURE}/data --split test "
     "--backend none", {}, 2, ["no split 'test'", "train, val"]),
    ("test-scale-below-the-runs-crop", f"trainer test --checkpoint {FIXTURE}/checkpoint.pt "
     f"--data {FIXTURE}/data --scale-size 16 --backend none", {}, 2,
     ["--scale-size 16", "smaller than --crop-size 24 (the run's)"]),
    ("cache-too-small", "trainer train --data {url}/v1/datasets/tiny --cache-dir {root}/cache --output-dir "
     "{root}/run-cache --backend none --depth 10 --width 4 --crop-size 32 --scale-size 36 --workers 0",
     {"FSSPEC_HTTP_HEADERS": "{auth}", "SHARD_CACHE_BUDGET": "1000"}, 1,
     ["cache budget of 1,000 bytes", "SHARD_CACHE_BUDGET"]),
    ("source-deadline-negative", "trainer train --data {set} --source-deadline -1", {}, 2,
     ["--source-deadline", "-1", "range"]),
    ("source-deadline-unreadable", "shards stats http://127.0.0.1:{port}/set",
     {"SHARD_SOURCE_DEADLINE": "10m"}, 2,
     ["$SHARD_SOURCE_DEADLINE='10m'", "seconds"]),
    ("source-down", "shards stats http://127.0.0.1:{port}/set", {"SHARD_SOURCE_DEADLINE": "1"}, 75,
     ["127.0.0.1:{port}/set/manifest.json", "no answer for", "past the source deadline of 1 s", "Connect"]),
    ("train-into-an-earlier-run", "trainer train --data {set} --output-dir {earlier} --backend none", {}, 2,
     ["--output-dir", "earlier", "--resume", "--overwrite"]),
    ("ema-with-k-step-averaging",
     "trainer train --data {set} --output-dir {root}/run-ema --backend none --depth 10 "
     "--ema-decay 0.99 --average-every 2", {}, 1, ["--ema-decay", "not with --average-every"]),
    ("test-ema-of-a-run-without",
     f"trainer test --checkpoint {FIXTURE}/checkpoint.pt --data {FIXTURE}/data --ema "
     "--backend none", {}, 1, ["checkpoint.pt", "--ema", "no weight average", "--ema-decay"]),
    ("decode-on-device-without-torchvision", "trainer train --data {set} --output-dir {root}/run-nvjpeg "
     "--backend none --depth 10 --width 4 --decode-on-device", {"PYTHONPATH": "{missing}:{pythonpath}"}, 2,
     ["--decode-on-device", "needs torchvision"]),
    ("horovod-not-installed", "trainer train --data {set} --output-dir {root}/run-hvd --depth 10",
     {"PYTHONPATH": "{missing}:{pythonpath}"}, 2, ["--backend horovod", "cannot import horovod",
                                                   "--backend none"]),
    ("bad-sample-stops-training",
     "trainer train --data {rotten} --output-dir {root}/run-rotten --backend none "
     "--depth 10 --width 4 --crop-size 32 --scale-size 36 --workers 1 --epochs 1", {}, 1,
     ["{rotten}/train/train-00000", ": shard train/train-00000", ", sample train_v000", ": xxh3-64 digest ",
      ", the manifest says ", "(read twice)"]),
    ("bad-samples-over-the-budget",
     "trainer train --data {rotten} --output-dir {root}/run-budget --backend none "
     "--depth 10 --width 4 --crop-size 32 --scale-size 36 --workers 1 --epochs 1 --max-bad-samples 1", {}, 1,
     ["2 samples of train in epoch 1 are bad (their digests differ from the manifest's",
      "more than --max-bad-samples 1", "(read twice)", "{root}/run-budget/bad-samples.jsonl"]),
    ("max-bad-samples-not-a-count", "trainer train --data {set} --max-bad-samples lots", {}, 2,
     ["--max-bad-samples", "'lots'", "a count (3) or a share in percent (0.5%)"]),
    ("stats-of-damaged-clips", "shards stats {rotten} --probe 0", {}, 1,
     ["2 clips read are damaged", "train/train-000000.tar sample train_v0000_c01",
      "train/train-000001.tar sample train_v0001_c01", "shards verify {rotten}"]),
    ("preview-of-damaged-clips", "shards preview {rotten} --clips 6 --out {root}/rotten.png", {}, 1,
     ["2 of the 6 clips shown are damaged", "marked so", "train/train-000000.tar sample train_v0000_c01"]),
    ("resume-a-truncated-checkpoint",
     "trainer train --data {set} --output-dir {damaged} --resume --backend none "
     "--depth 10 --width 4 --crop-size 32 --scale-size 36 --workers 0", {}, 1,
     ["--resume refused", "damaged/checkpoint.pt", "does not load: truncated or corrupt", "--overwrite"]),
    ("reshard-onto-a-full-disk", "shards reshard {set} {full}/new --num-shards 2", {}, 1,
     ["full/new/", "no space left on device", "the write needs", "are free", "nothing is left"]),
    # what reaches ingest from outside (docs/faults.md, "inputs")
    ("out-cannot-be-created", "ingest build --src {vids} --out /proc/kf-out", {}, 2,
     ["--out /proc/kf-out", "cannot be created", "No such file or directory"]),
    ("out-is-a-file", "ingest build --src {vids} --out {root}/tokens", {}, 2,
     ["--out {root}/tokens", "not a directory"]),
    ("short-side-huge", "ingest build --src {vids} --out {out} --short-side 99999999999", {}, 2,
     ["--short-side", "99999999999", "16 to 2048"]),
    ("out-holds-another-tools-files", "ingest build --src {vids} --out {foreign}", {}, 2,
     ["--out {foreign} holds 1 file no build of this project wrote", "val/val-000000.tar", "--force"]),
    ("cvdf-short-row", "ingest build --src {root}/cvdf-short-row --out {out}", {}, 2,
     ["cvdf-short-row/annotations/train.csv: line 3: 3 fields, the header has 6"]),
    ("cvdf-bad-number", "ingest build --src {root}/cvdf-bad-number --out {out}", {}, 2,
     ["cvdf-bad-number/annotations/train.csv: line 2: time_start 'ten' is not a number"]),
    ("cvdf-not-utf8", "ingest build --src {root}/cvdf-not-utf8 --out {out}", {}, 2,
     ["cvdf-not-utf8/annotations/train.csv: not UTF-8: byte 0xe9 at offset 52 (line 2)", "save it as UTF-8"]),
    ("cvdf-two-labels", "ingest build --src {root}/cvdf-two-labels --out {out}", {}, 2,
     ["cvdf-two-labels/annotations/train.csv: lines 2 and 4 give aaa_000010_000020 two labels",
      "'abseiling' and 'archery'"]),
    ("cvdf-label-line-break", "ingest build --src {root}/cvdf-label-line-break --out {out}", {}, 2,
     ["cvdf-label-line-break/annotations/train.csv: line 2: the label 'tying\\nbow tie' holds a line break"]),
    ("serve-without-its-extra", "shard-service serve --help",
     {"PYTHONPATH": "{noextras}:{pythonpath}", "KF_MISSING_MODULES": "aiohttp"}, 2,
     ["needs the service extra", "'aiohttp' is not installed", "pip install 'kinetics-fast[service]'"]),
    ("synth-without-its-extra", "ingest synth --out {root}/synth",
     {"PYTHONPATH": "{noextras}:{pythonpath}", "KF_MISSING_MODULES": "av,ray,ffmpeg,cv2,tqdm"}, 2,
     ["needs the ingest extra", "is not installed", "pip install 'kinetics-fast[ingest]'"]),
    # a set is one thing, with one identity (docs/faults.md)
    ("build-over-other-options", "ingest build --src {vids} --out {set} --frames 4", {}, 2,
     ["--out {set} holds a shard set built with other options", "--frames 8, now 4", "--force replaces it"]),
    ("resume-on-another-set",
     "trainer train --data {set} --output-dir {v0run} --resume --backend none --depth 10 "
     "--width 4 --crop-size 32 --scale-size 36 --workers 0", {}, 2,
     ["--resume refused", "v0run/checkpoint.pt was trained on a shard set whose inputs' fingerprint is",
      "but --data is shard set", "(6 train + 3 val clips, 8 frames) at {set}"]),
    ("build-of-a-changed-set", "ingest build --src {vids} --out {changed} --catalog {catalog} --frames 2 "
     "--short-side 16 --shard-samples 4", {}, 1,
     ["(changed) is changed", "{changed}/manifest.json changed since the set was registered",
      "--force rebuilds it"]),
    ("read-a-damaged-set", "shards stats {url}/v1/datasets/worn", {"FSSPEC_HTTP_HEADERS": "{auth}"}, 1,
     ["/v1/datasets/worn", "HTTP 409", "(worn) is damaged", "shard-service verify",
      "Prefer: handling=lenient"]),
    ("show-a-replaced-set", "shard-service show gone --catalog {catalog}", {}, 2,
     ["(gone) is replaced", "a build without a catalog was forced into", "--force"]),
    # the service past one process: a PostgreSQL catalog, replicas behind nginx (docs/runbooks/service.md)
    ("catalog-server-down", "shard-service list --catalog postgresql://kf:pw@127.0.0.1:{port}/catalog", {},
     75,
     ["the catalog postgresql://kf:***@127.0.0.1:{port}/catalog cannot be reached", "Connection refused"]),
    ("build-with-the-catalog-server-down", "ingest build --src {vids} --out {out} --catalog "
     "postgresql://kf@127.0.0.1:{port}/catalog", {}, 75,
     ["postgresql://kf@127.0.0.1:{port}/catalog cannot be reached"]),
    ("replica-without-a-data-root", "shard-service serve --catalog postgresql://kf@127.0.0.1:{port}/catalog "
     "--source-root {vids}", {}, 2, ["--data-root", "PostgreSQL catalog", "every replica reaches"]),
    ("x-accel-not-a-path", "shard-service serve --catalog {catalog} --x-accel-redirect _accel", {}, 2,
     ["--x-accel-redirect _accel", "plain URI path such as /_accel"]),
    # the server's start: refused before anything starts, the catalog not opened (docs/faults.md)
    ("serve-on-a-busy-port", "shard-service serve --catalog {catalog} --port {served_port}", {}, 1,
     ["127.0.0.1:{served_port}: address already in use", "another --port", "--port 0"]),
    ("serve-workers-on-a-busy-port",
     "shard-service serve --catalog {catalog} --port {served_port} --workers 2", {}, 1,
     ["127.0.0.1:{served_port}: address already in use"]),
    ("serve-host-not-here", "shard-service serve --catalog {catalog} --host 192.0.2.1 --port 0", {}, 2,
     ["--host 192.0.2.1", "not an address of this machine"]),
    ("serve-port-out-of-range", "shard-service serve --catalog {catalog} --port 99999", {}, 2,
     ["--port", "99999", "0 to 65535"]),
    ("serve-staleness-negative", "shard-service serve --catalog {catalog} --catalog-staleness -1", {}, 2,
     ["--catalog-staleness", "-1.0 is out of range: give 0 or more"]),
    ("serve-staleness-nan", "shard-service serve --catalog {catalog} --catalog-staleness nan", {}, 2,
     ["--catalog-staleness", "nan is out of range: give 0 or more"]),
    ("serve-catalog-typo", "shard-service serve --catalog {root}/typo/catalog.sqlite --port 0", {}, 2,
     ["typo/catalog.sqlite", "no such catalog", "--create"]),
    ("read-auth-without-tokens", "shard-service serve --catalog {catalog} --read-auth --port 0", {}, 2,
     ["--read-auth needs --token-file", "no one could read"]),
    ("token-file-typo", "shard-service serve --catalog {catalog} --token-file {root}/tokns --port 0", {}, 2,
     ["--token-file", "tokns", "no such file"]),
    # on two simulated nodes: every rank judges the same shares (``outcomes``)
    ("node-affine-on-a-class-sorted-set",
     "horovodrun -np 2 -H localhost:1,127.0.0.1:1 --gloo {bin}/trainer train "
     "--data {sorted} --shuffle node --output-dir {root}/run-sorted --epochs 1 --depth 10 --width 4 "
     "--crop-size 32 --scale-size 36 --workers 0", {}, 2,
     ["--shuffle node: node-affine epochs on 2 nodes would give them different classes",
      "train's stored order",
      "share is 0.50 from the whole set's class mix", "--shuffle global", "ingest build (hashed order)"]),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The files and the read-auth server the mistakes are made against."""
    root = tmp_path_factory.mktemp("newcomer")
    make_shardset(str(root / "set"), {"train": 6, "val": 3}, per_shard=3)
    make_shardset(str(root / "old"), {"train": 12}, per_shard=2)  # an earlier set, 6 shards
    make_shardset(str(root / "sorted"), {"train": 40, "val": 4}, per_shard=20, num_classes=2,
                  class_sorted=True)  # a class a shard
    make_shardset(str(root / "rotten"), {"train": 6, "val": 3}, per_shard=3)  # two training samples damaged:
    corrupt_sample(root / "rotten", "train", 0, 1, nbytes=40, mask=0xFF)  # clip 1, train_v0000_c01
    corrupt_sample(root / "rotten", "train", 1, 0, nbytes=40, mask=0xFF)  # clip 3, train_v0001_c01
    (root / "empty").mkdir()
    (root / "flat").mkdir()
    (root / "vids" / "train" / "a").mkdir(parents=True)
    for d in ("flat", "vids/train/a"):  # never decoded: every case here stops before
        for i in range(2):
            (root / d / f"v{i}.mp4").write_bytes(b"not decoded")
    for package in ("horovod", "torchvision"):  # a Python where they are missing, whatever this one has
        (root / "missing" / package).mkdir(parents=True)
        (root / "missing" / package / "__init__.py").write_text(f"raise ImportError('No module named "
                                                                f"{package}')\n")
    (root / "foreign" / "val").mkdir(parents=True)  # another tool's set: webdataset's naming, no manifest
    (root / "foreign" / "val" / "val-000000.tar").write_bytes(b"another tool's shard")
    header = "label,youtube_id,time_start,time_end,split,is_cc\n"
    for name, rows in {"short-row": "abseiling,aaa,10,20,train,0\narchery,bbb,5\n",
                       "bad-number": "abseiling,aaa,ten,20,train,0\n",
                       "two-labels": "abseiling,aaa,10,20,train,0\narchery,bbb,0,10,train,0\n"
                                     "archery,aaa,10,20,train,0\n",
                       "label-line-break": '"tying\nbow tie",aaa,10,20,train,0\n'}.items():
        (root / f"cvdf-{name}" / "annotations").mkdir(parents=True)
        (root / f"cvdf-{name}" / "annotations" / "train.csv").write_text(header + rows)
    (root / "cvdf-not-utf8" / "annotations").mkdir(parents=True)  # a spreadsheet's Latin-1 (é at byte 52)
    latin1 = (header + "caf\xe9,aaa,10,20,train,0\n").encode("latin-1")
    (root / "cvdf-not-utf8" / "annotations" / "train.csv").write_bytes(latin1)
    (root / "noextras").mkdir()  # a Python without the modules $KF_MISSING_MODULES names, as pip leaves it
    (root / "noextras" / "sitecustomize.py").write_text(
        "import os, sys\n"
        "class Missing:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in os.environ['KF_MISSING_MODULES'].split(','):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Missing())\n")
    (root / "earlier").mkdir()  # an earlier run's output directory
    for name in ("checkpoint.pt", "metrics.jsonl"):
        (root / "earlier" / name).write_text(f"the earlier run's {name}")
    (root / "damaged").mkdir()  # a run whose checkpoint was cut short after it was written
    (root / "damaged" / "checkpoint.pt").write_bytes((Path(FIXTURE) / "checkpoint.pt").read_bytes()[:30000])
    (root / "full").mkdir()  # a disk with room for no shard
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(root / "full")], check=True)
    cat = Catalog(str(root / "catalog.sqlite"))
    register(cat, str(root / "set"), "tiny")
    shutil.copytree(FIXTURE, root / "v0run", ignore=shutil.ignore_patterns("data"))  # a run on another set
    for name in ("worn", "gone"):
        make_shardset(str(root / name), {"train": 3}, per_shard=3)
    worn = register(cat, str(root / "worn"), "worn", dataset_id="cd" * 32)
    cat.record_verify(worn.id, 1, "train/train-000000.tar: SHA-256 differs from the manifest",
                      worn.verified_files)
    register(cat, str(root / "gone"), "gone", dataset_id="ce" * 32)
    cat.replace_at(str(root / "gone"), force=True)  # as `ingest build --force` into it does
    # registered as the build below asks for it
    make_shardset(str(root / "changed"), {"train": 2}, per_shard=2)
    register(cat, str(root / "changed"), "changed", dataset_id=registry.plan(
        str(root / "vids"), ClipConfig(frames=2, short_side=16), shard_samples=4).id)
    # then rebuilt behind its back
    shutil.copy(root / "old" / "manifest.json", root / "changed" / "manifest.json")
    (root / "tokens").write_text(TOKEN + "\n")
    try:
        server = ServiceProcess("--catalog", cat.path, "--token-file", str(root / "tokens"), "--read-auth")
        server.start()
        yield {"root": str(root), "vids": str(root / "vids"), "out": str(root / "out"),
               "set": str(root / "set"),
               "old": str(root / "old"), "rotten": str(root / "rotten"), "earlier": str(root / "earlier"),
               "catalog": cat.path, "url": server.url,
               "served_port": server.url.rsplit(":", 1)[1],
               "port": _free_port(), "auth": json.dumps({"Authorization": f"Bearer {TOKEN}"}),
               "damaged": str(root / "damaged"), "full": str(root / "full"),
               "v0run": str(root / "v0run"), "changed": str(root / "changed"), "sorted": str(root / "sorted"),
               "bin": BIN, "set_manifest": (root / "set" / "manifest.json").read_bytes(),
               "missing": str(root / "missing"), "pythonpath": os.environ.get("PYTHONPATH", ""),
               "foreign": str(root / "foreign"), "noextras": str(root / "noextras")}
        server.kill(15)
    finally:
        subprocess.run(["umount", "-l", str(root / "full")], check=True)


ANSWER_S = 300  # a trainer's refusal (import torch, start Horovod, build the net, read the manifest) took
# 90-150 s with four commands at once at load 25-35 (cache-too-small failed at the 120 s this was)


def run(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """A console script, as a user runs it."""
    return subprocess.run([os.path.join(BIN, argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=ANSWER_S, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def answers(world):
    """Every case's command run once, all at once; -> {id: (CompletedProcess, status, words)}."""
    def one(case):
        ident, line, env, status, words = case
        argv = [a.format(**world) for a in line.split()]
        try:
            answer = run(argv, {k: v.format(**world) for k, v in env.items()})
        except subprocess.TimeoutExpired as e:  # a command that never answers fails its case alone
            answer = subprocess.CompletedProcess(e.cmd, None, e.stdout or "", f"no answer in {e.timeout} s")
        return ident, (answer, status, [w.format(**world) for w in words])

    with ThreadPoolExecutor(4) as pool:
        return dict(pool.map(one, CASES))


def outcomes(p: subprocess.CompletedProcess, status: int) -> list[tuple[str, str, int | None]]:
    """(stdout, stderr, exit status) of what a case ran: the console script's; under horovodrun,
    each rank's (its ``[R]<...>:`` lines; its status from horovodrun's ``Process R exit with status
    code N.``), horovodrun's own report of the failure (a traceback) aside. horovodrun ends the
    other ranks once one has failed, so the ranks judged are those that ended by themselves with
    ``status``; the rank whose failure ended the job must be one of them."""
    if os.path.basename(str(p.args[0])) != "horovodrun":
        return [(p.stdout, p.stderr, p.returncode)]
    assert p.returncode == 1 and f"Exit code: {status}\n" in p.stderr, p.stderr[-3000:]
    ended = {int(r): int(n) for r, n in re.findall(r"^Process (\d+) exit with status code (-?\d+)\.$",
                                                   p.stdout, re.M)}
    lines = (p.stdout + p.stderr).splitlines()
    ranks = [("", "\n".join(line.split(":", 1)[1] for line in lines if line.startswith(f"[{r}]<")), n)
             for r, n in sorted(ended.items())]
    assert not [err for _, err, _ in ranks if "Traceback" in err], p.stderr[-3000:]
    return [rank for rank in ranks if rank[2] == status]


@pytest.mark.parametrize("ident", [c[0] for c in CASES])
def test_a_mistake_gets_one_line_naming_the_thing_and_the_reason(answers, ident):
    p, status, words = answers[ident]
    said = outcomes(p, status)
    assert said, (p.stdout, p.stderr)
    for stdout, stderr, code in said:
        assert "Traceback" not in stdout + stderr, stderr
        errors = [line for line in stderr.splitlines() if ": error: " in line]
        assert len(errors) == 1, stderr
        assert all(w in errors[0] for w in words), errors[0]
        assert code == status, (code, stderr)


def test_a_refusal_on_one_rank_ends_every_rank_with_one_line(world, tmp_path):
    """Two ranks under horovodrun, a cache budget too small on rank 1 alone: rank 1 says why in one
    line; rank 0, whose next collective fails once rank 1 has left, says so in one line too; no
    rank prints a traceback and the job ends (horovodrun's own report of the failed rank aside)."""
    only_rank_1 = 'if [ "$HOROVOD_RANK" = 1 ]; then export SHARD_CACHE_BUDGET=1000; fi; exec "$@"'
    trainer = [os.path.join(BIN, "trainer"), "train", "--data", f"{world['url']}/v1/datasets/tiny",
               "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(tmp_path / "run"),
               "--depth", "10", "--width", "4", "--crop-size", "32", "--scale-size", "36",
               "--batch-size", "1", "--workers", "0"]
    p = subprocess.run([os.path.join(BIN, "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", "bash",
                        "-c", only_rank_1, "rank", *trainer], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "FSSPEC_HTTP_HEADERS": world["auth"]})
    lines = {r: [line.split(":", 1)[1] for line in (p.stdout + p.stderr).splitlines()
                 if line.startswith(f"[{r}]<")] for r in (0, 1)}
    assert p.returncode == 1, p.stderr[-3000:]
    for r, says in ((1, "a cache budget of 1,000 bytes cannot hold"),
                    (0, "rank 0: another rank of the job stopped")):
        assert not [line for line in lines[r] if "Traceback" in line], lines[r]
        errors = [line for line in lines[r] if "trainer train: error: " in line]
        assert len(errors) == 1 and says in errors[0], lines[r]


def test_nothing_was_made_by_a_refused_command(answers, world):
    root = world["root"]
    assert not os.path.exists(os.path.join(root, "typo.sqlite"))  # the catalog a typo named
    assert not os.path.exists(os.path.join(root, "typo"))  # serve's: not even its directory
    assert not os.path.exists(os.path.join(root, "synth"))  # ingest synth without its extra
    with open(os.path.join(world["foreign"], "val", "val-000000.tar"), "rb") as f:  # another tool's set
        assert f.read() == b"another tool's shard" and os.listdir(world["foreign"]) == ["val"]
    assert not os.path.exists(world["out"]) and not os.path.exists(os.path.join(root, "new"))
    assert sorted(os.listdir(os.path.join(world["old"], "train"))) == [f"train-{i:06d}.tar" for i in range(6)]
    for name in ("checkpoint.pt", "metrics.jsonl"):  # training into an earlier run's directory
        with open(os.path.join(world["earlier"], name)) as f:
            assert f.read() == f"the earlier run's {name}"
    assert not os.path.exists(os.path.join(root, "run"))
    # node-affine refused: nothing trained
    assert not os.path.exists(os.path.join(root, "run-sorted", "checkpoint.pt"))
    assert os.listdir(os.path.join(root, "full", "new")) == []  # no shard, whole or partial, nor a temporary
    with open(os.path.join(root, "damaged", "checkpoint.pt"), "rb") as f:
        assert len(f.read()) == 30000
    with open(os.path.join(world["set"], "manifest.json"), "rb") as f:  # a build into it with other options
        assert f.read() == world["set_manifest"]
    assert sorted(os.listdir(world["v0run"])) == ["README.md", "checkpoint.pt", "expected.json",
                                                  "metrics.jsonl"]
    with open(os.path.join(world["v0run"], "checkpoint.pt"),
              "rb") as f, open(f"{FIXTURE}/checkpoint.pt", "rb") as g:
        assert f.read() == g.read()  # a resume onto another set


def test_reshard_into_an_old_set_is_refused_and_leaves_it_whole(world, tmp_path):
    """Before: 2 new shards and a 2-shard manifest beside the 6 old shards, which no manifest listed."""
    old = tmp_path / "old"
    make_shardset(str(old), {"train": 12}, per_shard=2)
    before = {p: p.read_bytes() for p in old.rglob("*") if p.is_file()}
    p = run(["shards", "reshard", world["set"], str(old), "--num-shards", "2"])
    assert p.returncode == 2 and "not empty" in p.stderr
    assert {p: p.read_bytes() for p in old.rglob("*") if p.is_file()} == before


def test_reshard_carries_the_class_list_and_ledger_and_says_when_shards_outnumber_clips(world, tmp_path):
    src = tmp_path / "src"
    make_shardset(str(src), {"train": 3}, per_shard=3)
    (src / "errors.jsonl").write_text('{"path": "train/a/x.mp4", "reason": "empty file (0 bytes)"}\n')
    p = run(["shards", "reshard", str(src), str(tmp_path / "dst"), "--num-shards", "5"])
    assert p.returncode == 0, p.stderr
    assert "train: 3 clips in 3 shards (--num-shards 5 is more than the clips allow)" in p.stdout
    for name in ("classes.txt", "errors.jsonl"):
        assert (tmp_path / "dst" / name).read_bytes() == (src / name).read_bytes()


def test_a_build_over_the_error_fraction_is_recorded_failed_never_reused_and_collected(
        ray_local, tmp_path, capsys):
    """Before: exit 1, but the set was registered ready, served and reused by the next build, whose
    message pointed to a ledger under its own --out, never created."""
    from ingest.cli import main as ingest
    from service.cli import main as service

    src = tmp_path / "src" / "train" / "a"
    src.mkdir(parents=True)
    media.make_video(src / "good.mp4", frames=6)
    media.make_not_a_video(src / "bad.mp4")
    cat = str(tmp_path / "catalog.sqlite")
    common = ["--src", str(tmp_path / "src"), "--catalog", cat, "--frames", "2", "--short-side", "16",
              "--max-error-fraction", "0.2"]
    assert ingest(["build", *common, "--out", str(tmp_path / "first")]) == 1
    ledger = tmp_path / "first" / "errors.jsonl"
    assert f"see {ledger}" in capsys.readouterr().err and "bad.mp4" in ledger.read_text()
    (rec,) = Catalog(cat).list()
    assert rec.state == "failed" and "1 of 2 videos failed" in rec.error

    assert ingest(["build", *common, "--out", str(tmp_path / "second")]) == 1
    out, err = capsys.readouterr()
    assert "reused" not in out and f"see {ledger}" in err  # the ledger that exists
    assert not (tmp_path / "second").exists()
    assert Catalog(cat).get(rec.id).state == "failed"

    assert service(["gc", "--yes", "--catalog", cat]) == 0
    assert f"removed {rec.id}" in capsys.readouterr().out
    assert Catalog(cat).get(rec.id).state == "deleted" and not ledger.exists()


def test_overwrite_starts_an_earlier_runs_directory_afresh(world, tmp_path):
    """Before: a second run into the directory replaced the checkpoint and appended to metrics.jsonl,
    so `trainer plot` mixed two runs. Now it is refused (the table above) unless --resume or
    --overwrite, which deletes the run's files, and only those."""
    out = tmp_path / "run"
    (out / "tensorboard").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"event": "epoch", "epoch": 7, "step": 70, "val_top1": 99.0}\n')
    (out / "checkpoint.pt").write_text("the earlier run's")
    (out / "notes.txt").write_text("mine")
    p = run(["trainer", "train", "--data", world["set"], "--output-dir", str(out), "--overwrite", "--backend",
             "none",
             "--depth", "10", "--width", "4", "--crop-size", "32", "--scale-size", "36", "--batch-size", "3",
             "--epochs", "1", "--warmup-epochs", "0", "--workers", "0", "--no-tensorboard"])
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr and f"checkpoint to {out / 'checkpoint.pt'}" in p.stderr
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["event"] == "epoch"]
    assert [e["epoch"] for e in epochs] == [1]  # this run's only
    assert (out / "notes.txt").read_text() == "mine" and not (out / "tensorboard").exists()


def test_each_rank_runs_its_share_of_the_cores_unless_omp_num_threads_says(tmp_path):
    """horovodrun -np 2 on 2 cores ran 28x slower with each rank's default of 2 threads."""
    probe = ("import os; os.sched_setaffinity(0, set(list(os.sched_getaffinity(0))[:2])); "
             "from trainer.distributed import cores; import torch; "
             "import sys; ranks = int(sys.argv[1]); "
             "print(cores.cap_threads(ranks), torch.get_num_threads(), cores.default_workers(2), "
             "cores.default_workers(1))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cpus = min(2, len(os.sched_getaffinity(0)))
    out = subprocess.run([sys.executable, "-c", probe, "2"], capture_output=True, text=True, env=env,
                         check=True).stdout
    assert out.split() == ["1", "1", "0", str(cpus - 1)], out  # 2 ranks: a core and no worker each
    out = subprocess.run([sys.executable, "-c", probe, "1"], capture_output=True, text=True, check=True,
                         env={**env, "OMP_NUM_THREADS": "1"}).stdout
    assert out.split()[:2] == ["None", "1"], out  # one rank would take both cores, but the reader said 1


def test_the_by_epoch_table_of_a_short_run_ends_with_its_last_epoch(tmp_path):
    from trainer.plot import tables

    for run, epochs in (("short", 3), ("long", 20)):
        (tmp_path / run).mkdir()
        (tmp_path / run / "metrics.jsonl").write_text("".join(
            json.dumps({"event": "epoch", "step": 10 * e, "epoch": e, "val_top1": float(e), "train_loss": 1.0,
                        "data_time": 0.01, "compute_time": 0.02, "clips_per_s": 5.0}) + "\n"
            for e in range(1, epochs + 1)))
    for runs, last in ((["short"], 3), (["long"], 20), (["short", "long"], 20)):
        rows = tables([str(tmp_path / r) for r in runs], runs).split("\n\n")[0].splitlines()[2:]
        assert int(rows[0].split("|")[0]) == 1 and int(rows[-1].split("|")[0]) == last, rows
