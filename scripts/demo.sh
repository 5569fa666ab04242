#!/usr/bin/env bash
# The main job on an embedded default: a small generated Kinetics-style dataset, ingested by a
# local Ray into WebDataset shards under demo/, then checked and summarised.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
.venv/bin/ingest synth --out demo/src
.venv/bin/ingest build --src demo/src --out demo/shards --shard-size 4MB
.venv/bin/shards verify demo/shards
.venv/bin/shards stats demo/shards
