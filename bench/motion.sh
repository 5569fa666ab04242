#!/usr/bin/env bash
# TSM against TSN on motion-only data, through the command-line tools, keeping the curves.
#
# The run of tests/test_motion.py (same data and flags), kept instead of thrown away: four
# classes that differ only in the direction a textured disc moves, 64x64 videos, 4-frame clips,
# a ResNet-10 of width 32 on 48 px crops, 12 epochs on 2 CPU cores (a few minutes per model).
# `trainer plot` draws the curves and prints validation top-1 by epoch and each run's final figures.
# scripts/demo.sh is the quick version (32 px crops, width 16, both models trained at once).
#
#   bash bench/motion.sh [WORKDIR] [PNG]        # defaults: /tmp/kinetics-fast-motion, motion.png
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/kinetics-fast-motion}
png=${2:-motion.png}
py=.venv/bin/python
[ -x "$py" ] || py=python3
export RAY_ADDRESS=
flags=(--segments 4 --depth 10 --width 32 --crop-size 48 --scale-size 48 --no-flip --batch-size 16
       --epochs 12 --warmup-epochs 2 --lr-per-8 0.025 --workers 1 --print-freq 8 --no-tensorboard)

"$py" -m ingest synth --out "$work/videos" --classes 4 --train-per-class 64 --val-per-class 16 \
    --width 64 --height 64 --fps 10 --seconds 2 --workers 2
"$py" -m ingest build --src "$work/videos" --out "$work/shards" --frames 4 --clips-per-video 4 \
    --short-side 48 --shard-samples 64 --workers 2
for model in tsm tsn; do
    extra=()
    [ "$model" = tsn ] && extra=(--no-shift)
    rm -rf "${work:?}/$model"
    "$py" -m trainer train --data "$work/shards" --output-dir "$work/$model" "${flags[@]}" "${extra[@]}"
done
"$py" -m trainer plot "$work/tsm" "$work/tsn" --labels TSM "TSN (no shift)" --out "$png"  # prints the tables too
