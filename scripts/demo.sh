#!/usr/bin/env bash
# The first run, after scripts/setup.sh: raw videos to trained models, every stage real, ending with
# what the project is for. A generated Kinetics-style dataset whose four classes differ only in the
# direction a textured disc moves (any single frame fits every class) is ingested by a local Ray
# into WebDataset shards, checked and planned; then TSM and TSN (the same network without the
# temporal shift) are trained side by side, one CPU core each, and compared: TSM learns the motion,
# TSN, which sees frames but not their order, stays near chance (25%). About 3 minutes on 2 cores.
# Usage: bash scripts/demo.sh [--out DIR]   (default: demo/ in the checkout)
set -euo pipefail
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || { echo "demo: --out needs a directory" >&2; exit 2; }; out=$(realpath -m "$2"); shift 2 ;;
    --out=*) out=$(realpath -m "${1#--out=}"); shift ;;
    -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "demo: unknown argument '$1' (usage: bash scripts/demo.sh [--out DIR])" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
out=${out:-$PWD/demo}
mkdir -p "$out"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # keep Ray on 127.0.0.1
bin=.venv/bin
[ -x "$bin/trainer" ] || { echo "demo: run 'bash scripts/setup.sh' first" >&2; exit 1; }
"$bin/python" -c "import importlib.metadata as m, PIL; assert m.version('pillow-simd') == PIL.__version__" ||
  { echo "demo: PIL is not pillow-simd: run 'bash scripts/setup.sh'" >&2; exit 1; }

echo "== 1/4 data: 320 videos (64x64, 2 s), ingested into shards of 4-frame JPEG clips"
"$bin/ingest" synth --out "$out"/src --classes 4 --train-per-class 64 --val-per-class 16 --width 64 --height 64 --fps 10 --seconds 2
"$bin/ingest" build --src "$out"/src --out "$out"/shards --frames 4 --clips-per-video 4 --short-side 32 --shard-samples 64
"$bin/shards" verify "$out"/shards
"$bin/shards" stats "$out"/shards
"$bin/shards" preview "$out"/shards --split val --clips 8 --out "$out"/preview.png   # look before training
"$bin/shards" plan "$out"/shards --max-world-size 64 --world-sizes 1,2,4,8,16,64

# A ResNet-10 of width 16 on 32 px crops, 4 frames, no flips (left and right are classes). The
# features that see motion appear after a few hundred steps, then TSM's accuracy jumps.
train=(--data "$out"/shards --segments 4 --depth 10 --width 16 --crop-size 32 --scale-size 32 --no-flip
       --batch-size 16 --epochs 16 --warmup-epochs 1 --lr-per-8 0.1 --workers 0 --print-freq 8)
echo "== 2/4 training TSM and TSN side by side, one core each (logs: $out/tsm.log, $out/tsn.log)"
rm -rf "$out"/tsm "$out"/tsn
OMP_NUM_THREADS=1 "$bin/trainer" train "${train[@]}" --output-dir "$out"/tsm > "$out"/tsm.log 2>&1 & tsm=$!
OMP_NUM_THREADS=1 "$bin/trainer" train "${train[@]}" --output-dir "$out"/tsn --no-shift > "$out"/tsn.log 2>&1 & tsn=$!
trap 'kill $tsm $tsn 2>/dev/null' EXIT
status() {  # "epoch E, val top-1 A%" from a run's metrics.jsonl
  local last
  last=$(grep '"event": "epoch"' "$out/$1/metrics.jsonl" 2>/dev/null | tail -1)
  [ -n "$last" ] || { echo "starting"; return; }
  # rounded as trainer plot's table rounds it (trainer.metrics.figure: the value's %.1f)
  sed -E 's/.*"epoch": ([0-9]+).*"val_top1": ([0-9.eE+-]+).*/\1 \2/' <<< "$last" |
    awk '{ printf "epoch %d, val top-1 %.1f%%\n", $1, $2 }'
}
shown=""
while kill -0 $tsm 2>/dev/null || kill -0 $tsn 2>/dev/null; do
  now="TSM: $(status tsm) | TSN: $(status tsn)"
  [ "$now" = "$shown" ] || { echo "  $now"; shown=$now; }
  sleep 2
done
wait $tsm || { tail -20 "$out"/tsm.log; exit 1; }
wait $tsn || { tail -20 "$out"/tsn.log; exit 1; }
trap - EXIT

echo "== 3/4 testing TSM (three crops per clip)"
"$bin/trainer" test --checkpoint "$out"/tsm/checkpoint.pt --data "$out"/shards --split val --crops 3 --workers 0 \
  --output "$out"/tsm/test-val.json

echo "== 4/4 TSM against TSN"
"$bin/trainer" plot "$out"/tsm "$out"/tsn --labels TSM TSN --out "$out"/tsm-vs-tsn.png
# A backslash-newline in the text below joins two lines: each command prints as one line, as pasted.
# tests/test_docs.py runs every line of the list.
cat <<EOF

Where things are:
  $out/src/                 the generated videos (class folders: $out/src/{train,val}/<class>/*.mp4)
  $out/shards/              WebDataset shards, manifest.json, classes.txt, errors.jsonl
  $out/preview.png          8 validation clips, a row each (shards preview; --html DIR for a page)
  $out/tsm/, $out/tsn/      checkpoint.pt, metrics.jsonl, tensorboard/; $out/tsm/test-val.json
  $out/tsm-vs-tsn.png       loss, accuracy, learning rate and throughput of both runs
What to run next (after 'source .venv/bin/activate'; each about a minute on a laptop CPU):
  trainer train --help
  horovodrun -np 2 -H localhost:2 --gloo trainer train --data $out/shards --output-dir $out/hvd --overwrite \
--segments 4 --depth 10 --width 16 --crop-size 32 --scale-size 32 --no-flip --batch-size 16 --epochs 2 \
--warmup-epochs 1 --lr-per-8 0.1 --workers 0
  ingest build --src $out/src --out $out/mine --catalog $out/catalog.sqlite --frames 4 --clips-per-video 1 \
--short-side 32 --shard-samples 64
  shard-service serve --catalog $out/catalog.sqlite --port 8765
(the horovodrun line: two ranks on this machine, Gloo on 127.0.0.1; ingest build: your own videos in
place of $out/src, as class folders SRC/{train,val}/<class>/*.mp4, CVDF, UCF101 or HMDB51: README.md;
shard-service serve: the viewer at http://127.0.0.1:8765/, Ctrl-C stops it. Clusters, Lustre/GPFS,
Slurm, 1,536 GPUs: docs/runbooks/)
EOF
