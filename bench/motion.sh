#!/usr/bin/env bash
# TSM against TSN on motion-only data, and TSN's motion stream on the stored motion fields, through the
# command-line tools, keeping the curves.
#
# The runs of tests/test_motion.py (same data and flags), kept instead of thrown away: four classes
# that differ only in the direction a textured disc moves, 64x64 videos, 4-frame clips, a ResNet-10 of
# width 32 on 48 px crops, 12 epochs on 2 CPU cores (a few minutes per model). The set is built with
# --motion mv (its JPEGs are those of a build without it) and once more with --motion flow; the models
# (--models, default the first four):
#   tsm, tsn                RGB, with and without the temporal shift
#   motion-mv, motion-flow  a TSN (no shift) of --modality motion on the codec's vectors / on DIS flow
#   i3d-3x3x3, i3d-3x1x1    RGB, the 3D baselines (--arch): a ResNet-50 of width 16 (an I3D inflates
#                           bottlenecks, which ResNet-10 has none of; about the parameters of TSM's
#                           ResNet-10 of width 32), the same recipe otherwise
# `trainer plot` draws the curves and prints validation top-1 by epoch and each run's final figures.
# scripts/demo.sh is the quick version (32 px crops, width 16, TSM and TSN trained at once).
#
# --nodes 2: the same recipe (global batch 16) on two Horovod ranks of 8 clips, on two simulated
# nodes (horovodrun -H localhost:1,127.0.0.1:1), once per mode of --shuffles with the same seed:
# node-affine epochs (each node reads only its 8 of the 16 training shards, all run) against
# global ones.
# --seeds "0 1 2 3": every run once per seed (--seed; run directories MODEL[-SHUFFLE]-sSEED), for paired
# differences between the modes (bench/paired.py); --keep: a run whose log says done and whose
# command line (WORKDIR/RUN.cmd) is this one's is kept, not trained again (a campaign stopped partway).
# Each run's output also goes to WORKDIR/RUN.log.
#
#   bash bench/motion.sh [--nodes 2 --shuffles "global node"] [--models "tsm tsn"] [--seeds "0 1"] [--keep]
#                        [WORKDIR] [PNG]   # defaults: /tmp/kinetics-fast-motion, motion.png
#   EPOCHS=3 bash bench/motion.sh ...  # shorter runs (the motion stream is at 100% after one)
set -euo pipefail
nodes=1 shuffles=global models="tsm tsn motion-mv motion-flow" seeds="" keep=0
while [[ ${1:-} == --* ]]; do
    case $1 in
        --nodes) nodes=$2 ;;
        --shuffles) shuffles=$2 ;;
        --models) models=$2 ;;
        --seeds) seeds=$2 ;;
        --keep) keep=1; shift; continue ;;
        *) echo "motion.sh: unknown option $1 (--nodes, --shuffles, --models, --seeds, --keep)" >&2; exit 2 ;;
    esac
    shift 2
done
for seed in $seeds; do
    [[ $seed =~ ^[0-9]+$ ]] || { echo "motion.sh: --seeds: whole numbers, not $seed" >&2; exit 2; }
done
case $nodes in 1|2) ;; *) echo "motion.sh: --nodes $nodes: 1 or 2 simulated nodes" >&2; exit 2 ;; esac
for model in $models; do
    case $model in tsm|tsn|motion-mv|motion-flow|i3d-3x3x3|i3d-3x1x1) ;;
        *) echo "motion.sh: --models: tsm, tsn, motion-mv, motion-flow, i3d-3x3x3 or i3d-3x1x1, not $model" >&2
           exit 2 ;; esac
done
if [ "$nodes" = 1 ] && [ "$shuffles" != global ]; then
    echo "motion.sh: --shuffles $shuffles needs --nodes 2 (node-affine epochs on one node are global ones)" >&2; exit 2
fi
cd "$(dirname "$0")/.."
work=${1:-/tmp/kinetics-fast-motion}
png=${2:-motion.png}
py=.venv/bin/python
[ -x "$py" ] || py=python3
hvd=$(dirname "$py")/horovodrun
[ -x "$hvd" ] || hvd=horovodrun
export RAY_ADDRESS=
flags=(--segments 4 --depth 10 --width 32 --crop-size 48 --scale-size 48 --no-flip
       --epochs "${EPOCHS:-12}" --warmup-epochs 2 --lr-per-8 0.025 --workers 1 --print-freq 8 --no-tensorboard)

[ -d "$work/videos" ] || "$py" -m ingest synth --out "$work/videos" --classes 4 --train-per-class 64 --val-per-class 16 \
    --width 64 --height 64 --fps 10 --seconds 2 --workers 2
kinds=mv
[[ " $models " == *" motion-flow "* ]] && kinds="mv flow"
for kind in $kinds; do
    [ -f "$work/shards-$kind/manifest.json" ] && continue
    "$py" -m ingest build --src "$work/videos" --out "$work/shards-$kind" --frames 4 --clips-per-video 4 \
        --short-side 48 --shard-samples 64 --workers 2 --motion "$kind"
done
# train RUN CMD...: the run's command, its output on the terminal and in WORKDIR/RUN.log; with --keep,
# skipped when that log says done and WORKDIR/RUN.cmd holds the same command
train() {
    local run=$1; shift
    local cmd="$*"
    if [ "$keep" = 1 ] && grep -qa "trainer.train: done:" "$work/$run.log" 2>/dev/null \
            && [ "$(cat "$work/$run.cmd" 2>/dev/null)" = "$cmd" ]; then
        echo "motion.sh: $run kept (finished with this command)"
        return
    fi
    rm -rf "${work:?}/$run"
    printf '%s' "$cmd" > "$work/$run.cmd"
    "$@" 2>&1 | tee "$work/$run.log"
}
read -ra seed_list <<< "$seeds"
[ ${#seed_list[@]} -gt 0 ] || seed_list=("")  # one run per model (and shuffle) at the trainer's default seed
runs=() labels=()
for model in $models; do
    case $model in
        tsm) data=mv extra=() label=TSM ;;
        tsn) data=mv extra=(--no-shift) label="TSN (no shift)" ;;
        motion-mv) data=mv extra=(--no-shift --modality motion) label="motion TSN (mv)" ;;
        motion-flow) data=flow extra=(--no-shift --modality motion) label="motion TSN (flow)" ;;
        i3d-*) data=mv extra=(--arch "$model" --depth 50 --width 16) label="I3D ${model#i3d-} (R50 w16)" ;;
    esac
    for seed in "${seed_list[@]}"; do
        seeded=() suffix="" seedlabel=""
        [ -n "$seed" ] && seeded=(--seed "$seed") suffix="-s$seed" seedlabel=", seed $seed"
        if [ "$nodes" = 1 ]; then
            train "$model$suffix" "$py" -m trainer train --data "$work/shards-$data" --output-dir "$work/$model$suffix" \
                --batch-size 16 "${flags[@]}" "${extra[@]}" "${seeded[@]}"
            runs+=("$work/$model$suffix") labels+=("$label$seedlabel")
            continue
        fi
        for shuffle in $shuffles; do
            train "$model-$shuffle$suffix" env OMP_NUM_THREADS=1 "$hvd" -np 2 -H localhost:1,127.0.0.1:1 --gloo \
                "$py" -m trainer train --data "$work/shards-$data" --output-dir "$work/$model-$shuffle$suffix" \
                --batch-size 8 --shuffle "$shuffle" "${flags[@]}" "${extra[@]}" "${seeded[@]}"
            runs+=("$work/$model-$shuffle$suffix") labels+=("$label, $shuffle$seedlabel")
        done
    done
done
"$py" -m trainer plot "${runs[@]}" --labels "${labels[@]}" --out "$png"  # prints the tables too
