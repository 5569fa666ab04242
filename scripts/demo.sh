#!/usr/bin/env bash
# The main job on an embedded default: a small generated Kinetics-style dataset, ingested by a
# local Ray into WebDataset shards under demo/, checked and summarised, then a tiny TSM trained
# on it for two epochs (one process) and tested: raw videos to a model, every stage real.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
.venv/bin/ingest synth --out demo/src
.venv/bin/ingest build --src demo/src --out demo/shards --shard-size 4MB
.venv/bin/shards verify demo/shards
.venv/bin/shards stats demo/shards
.venv/bin/shards plan demo/shards --max-world-size 64 --world-sizes 1,2,4,8,16,64
.venv/bin/trainer train --data demo/shards --output-dir demo/run --depth 18 --width 16 --crop-size 112 \
  --scale-size 128 --no-flip --batch-size 8 --epochs 2 --warmup-epochs 1 --lr-per-8 0.01 --workers 2
.venv/bin/trainer test --checkpoint demo/run/checkpoint.pt --data demo/shards --split val --workers 2
.venv/bin/trainer plot demo/run --out demo/run/curves.png
