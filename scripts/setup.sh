#!/usr/bin/env bash
# Installs everything this project needs into ./.venv, system packages included: the one installer
# for a laptop, a cluster node and both container images (docker/).
#
#   bash scripts/setup.sh                       # CPU: torch (CPU), Horovod with Gloo
#   KF_DEVICE=cuda bash scripts/setup.sh        # GPU nodes: CUDA torch + torchvision, Horovod with
#                                               # NCCL, Gloo and MPI (needs nvcc: a CUDA devel image)
#   KF_MPI=1 bash scripts/setup.sh              # CPU, plus Horovod with MPI (for mpirun / srun)
#
# Other knobs: VENV (default .venv), PYTHON (the interpreter the venv is made from),
# TORCH_INDEX_URL (a wheel index for torch/torchvision, e.g. PyTorch's CPU-only index on machines
# whose default index serves the CUDA build), KF_EXTRAS (the project's extras; default
# ingest,service,trainer,s3,dev: the images' build stage leaves out dev, the test and lint tools).
#
# Idempotent: every step first checks its result and is skipped when it is there, so a second run
# takes seconds and rebuilds nothing (tests/test_setup.py runs it twice). Two things made earlier
# versions redo work on every run: the editable install of the project ran every time, and each
# run re-resolved matplotlib's `pillow` requirement, which pillow-simd (distribution name
# "pillow-simd") does not satisfy, so stock Pillow came back over it and pillow-simd was reinstalled.
# Now the editable install runs only when pyproject.toml or the checkout changed, and pillow-simd
# is built once into $VENV/wheels: if a dependency change ever brings Pillow back, it is put back
# from that wheel in a second, never rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
KF_DEVICE=${KF_DEVICE:-cpu}
KF_EXTRAS=${KF_EXTRAS:-ingest,service,trainer,s3,dev}
case "$KF_DEVICE" in cpu) KF_MPI=${KF_MPI:-0};; cuda) KF_MPI=${KF_MPI:-1};;
  *) echo "setup: KF_DEVICE must be cpu or cuda, not '$KF_DEVICE'" >&2; exit 2;; esac

# Pinned versions: torchvision 0.28.0 is the release built against torch 2.13.0.
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0
PILLOW_SIMD_VERSION=12.1.1.post0
HOROVOD_VERSION=0.28.1

changed=()  # what this run did; empty when everything was already there
did() { changed+=("$1"); echo "setup: $2"; }

need_apt=()
if command -v "$PY" >/dev/null; then  # a venv, and Python's headers for the source builds below
  "$PY" -c "import ensurepip" 2>/dev/null || need_apt+=(python3-venv)
  "$PY" -c "import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_paths()['include'] + '/Python.h'))" ||
    need_apt+=(python3-dev)
else
  need_apt+=(python3 python3-venv python3-dev)  # e.g. a bare CUDA base image
fi
command -v ffmpeg >/dev/null || need_apt+=(ffmpeg)
command -v cmake >/dev/null || need_apt+=(cmake)
command -v g++ >/dev/null || need_apt+=(g++)
command -v make >/dev/null || need_apt+=(make)  # cmake's generator for Horovod; not in slim or minimal images
command -v strace >/dev/null || need_apt+=(strace)  # tests/helpers/syscalls.py and bench/loader.py count metadata syscalls with it
dpkg -s libjpeg-dev >/dev/null 2>&1 || need_apt+=(libjpeg-dev)
dpkg -s zlib1g-dev >/dev/null 2>&1 || need_apt+=(zlib1g-dev)
dpkg -s libjpeg62-turbo-dev >/dev/null 2>&1 || need_apt+=(libjpeg62-turbo-dev)  # crop decoding builds on it
dpkg -s libturbojpeg0 >/dev/null 2>&1 || need_apt+=(libturbojpeg0)  # PyTurboJPEG, compared in bench/loader.py
if [ "$KF_MPI" = 1 ]; then
  dpkg -s libopenmpi-dev >/dev/null 2>&1 || need_apt+=(libopenmpi-dev)
  command -v mpirun >/dev/null || need_apt+=(openmpi-bin)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  did apt "apt-get install ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

[ -x "$VENV/bin/python" ] || { did venv "virtual environment $VENV"; "$PY" -m venv "$VENV"; }
VPY=$VENV/bin/python
pip() { "$VPY" -m pip "$@"; }
pyok() { "$VPY" -c "$1" >/dev/null 2>&1; }
torch_index=(); [ -n "${TORCH_INDEX_URL:-}" ] && torch_index=(--index-url "$TORCH_INDEX_URL")

# --- torch (and torchvision for nvJPEG on GPUs); versions read from metadata, no import needed
torch_want=("torch==$TORCH_VERSION")
torch_check="from importlib.metadata import version as v; assert v('torch').split('+')[0] == '$TORCH_VERSION'"
if [ "$KF_DEVICE" = cuda ]; then
  torch_want+=("torchvision==$TORCHVISION_VERSION")
  torch_check+="; assert '+cpu' not in v('torch'); assert v('torchvision').split('+')[0] == '$TORCHVISION_VERSION'"
fi
pyok "$torch_check" || {
  did torch "${torch_want[*]} ($KF_DEVICE)"
  pip install -q --upgrade pip wheel setuptools
  pip install -q "${torch_index[@]}" "${torch_want[@]}"; }

# --- this project, editable, with $KF_EXTRAS (by default every extra but bench; the base install is
# only what reading needs: docs/library.md), at the tested versions of constraints.txt: only when the
# checkout, the extras, pyproject.toml or constraints.txt changed
stamp="$VENV/.kinetics-fast-installed"
want_stamp="$ROOT [$KF_EXTRAS] $(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want_stamp" ] || ! pyok "import importlib.metadata as m; m.distribution('kinetics-fast')"; then
  did project "kinetics-fast (editable) and its dependencies"
  pip install -q -c constraints.txt -e ".[$KF_EXTRAS]"
  echo "$want_stamp" > "$stamp"
fi

# --- pillow-simd in place of Pillow (same import name), built once from source into $VENV/wheels
simd_ok="import importlib.metadata as m, PIL
assert m.version('pillow-simd') == PIL.__version__ == '$PILLOW_SIMD_VERSION'
try:
    m.distribution('pillow')
except m.PackageNotFoundError:
    pass
else:
    raise SystemExit('stock Pillow is installed too')"
pyok "$simd_ok" || {
  wheels="$VENV/wheels"
  wheel=$(ls "$wheels"/pillow_simd-"$PILLOW_SIMD_VERSION"-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$wheel" ]; then
    did pillow-simd-build "pillow-simd $PILLOW_SIMD_VERSION (built from source once, ~2 min)"
    simd_cc=cc; grep -qw avx2 /proc/cpuinfo && simd_cc="cc -mavx2"
    CC="$simd_cc" pip wheel -q --no-deps --no-binary pillow-simd -w "$wheels" "pillow-simd==$PILLOW_SIMD_VERSION"
    wheel=$(ls "$wheels"/pillow_simd-"$PILLOW_SIMD_VERSION"-*.whl | head -1)
  fi
  did pillow-simd "pillow-simd $PILLOW_SIMD_VERSION in place of Pillow (from $wheel)"
  pip uninstall -q -y pillow pillow-simd >/dev/null 2>&1 || true
  pip install -q --no-deps --force-reinstall "$wheel"; }

# --- Horovod, built against the installed torch. 0.28.1 forces C++14 but torch >= 2.1 needs C++17:
# a cmake wrapper injects a project include that maps the C++14 flags to C++17
# (../shared/notes/horovod.md). NCCL comes from torch's own nvidia-nccl wheel, so Horovod and torch
# share one NCCL.
hvd_features=gloo; [ "$KF_MPI" = 1 ] && hvd_features+=",mpi"; [ "$KF_DEVICE" = cuda ] && hvd_features+=",nccl"
hvd_check="import horovod.torch as h; assert h.gloo_built()"
[ "$KF_MPI" = 1 ] && hvd_check+="; assert h.mpi_built()"
[ "$KF_DEVICE" = cuda ] && hvd_check+="; assert h.nccl_built()"
# What is installed, from metadata (importing torch to ask would cost seconds on every run).
hvd_have=$("$VPY" -c "import importlib.metadata as m
def v(n):
    try: return m.version(n)
    except m.PackageNotFoundError: return 'none'
print('horovod', v('horovod'), 'torch', v('torch'))")
hvd_stamp="$VENV/.horovod-built"
hvd_want="$hvd_have $hvd_features"
if [ "$(cat "$hvd_stamp" 2>/dev/null)" != "$hvd_want" ]; then
  pyok "$hvd_check" || {
    did horovod "horovod $HOROVOD_VERSION ($hvd_features) built against torch (~5 min the first time)"
    hv=$(mktemp -d)
    cat > "$hv/cxx17.cmake" <<'CM'
set(CMAKE_CXX14_STANDARD_COMPILE_OPTION "-std=c++17")
set(CMAKE_CXX14_EXTENSION_COMPILE_OPTION "-std=gnu++17")
CM
    cat > "$hv/cmake" <<SH
#!/usr/bin/env bash
for a in "\$@"; do case "\$a" in --build|-E|--version) exec cmake "\$@";; esac; done
exec cmake -DCMAKE_PROJECT_INCLUDE=$hv/cxx17.cmake "\$@"
SH
    chmod +x "$hv/cmake"
    hvd_env=(HOROVOD_CMAKE="$hv/cmake" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1
             HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=-j"$(nproc)")
    if [ "$KF_MPI" = 1 ]; then hvd_env+=(HOROVOD_WITH_MPI=1); else hvd_env+=(HOROVOD_WITHOUT_MPI=1); fi
    if [ "$KF_DEVICE" = cuda ]; then
      nccl=$("$VPY" -c "import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])")  # nvidia/nccl/{include,lib}
      [ -e "$nccl/lib/libnccl.so" ] || ln -s libnccl.so.2 "$nccl/lib/libnccl.so"  # the wheel ships only .so.2
      hvd_env+=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_INCLUDE="$nccl/include" HOROVOD_NCCL_LIB="$nccl/lib"
                HOROVOD_NCCL_LINK=SHARED HOROVOD_CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}")
    fi
    pip uninstall -q -y horovod >/dev/null 2>&1 || true
    env "${hvd_env[@]}" "$VPY" -m pip install -q --no-build-isolation "horovod==$HOROVOD_VERSION"
    rm -rf "$hv"
    pyok "$hvd_check" || { echo "setup: error: horovod does not import with $hvd_features" >&2; exit 1; }
    hvd_want="$("$VPY" -c "import importlib.metadata as m; print('horovod', m.version('horovod'), 'torch', m.version('torch'))") $hvd_features"; }
  echo "$hvd_want" > "$hvd_stamp"
fi

# --- crop decoding (trainer/data/cropdecode.py): trainer/libcropjpeg.so from csrc/cropjpeg.c, built only
# when missing or older than its source. The trainer runs without it, decoding whole frames.
if [ ! trainer/libcropjpeg.so -nt csrc/cropjpeg.c ]; then
  did cropjpeg "crop-decoding library trainer/libcropjpeg.so"
  bash scripts/build-native.sh || echo "setup: crop decoding library not built: the trainer will decode whole frames"
fi

# Every run ends by checking the result, so a later step that brought stock Pillow back is caught.
pyok "$simd_ok" || { echo "setup: error: PIL in $VENV is not pillow-simd $PILLOW_SIMD_VERSION" >&2; exit 1; }
echo "setup: ready ($VENV: $KF_DEVICE, torch $TORCH_VERSION, pillow-simd $PILLOW_SIMD_VERSION, horovod $HOROVOD_VERSION" \
     "$hvd_features); ${changed[*]:-nothing to do: everything was already in place}"
