#!/usr/bin/env bash
# Installs everything this project needs into ./.venv, system packages included.
# Idempotent: each step is skipped when what it makes is already there, so the test
# command can call it on every run. Reuses pip's wheel cache (Horovod's built wheel too).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

need_apt=()
command -v ffmpeg >/dev/null || need_apt+=(ffmpeg)
command -v cmake >/dev/null || need_apt+=(cmake)
command -v g++ >/dev/null || need_apt+=(g++)
command -v strace >/dev/null || need_apt+=(strace)  # bench/loader.py counts metadata syscalls with it
dpkg -s libjpeg-dev >/dev/null 2>&1 || need_apt+=(libjpeg-dev)
dpkg -s zlib1g-dev >/dev/null 2>&1 || need_apt+=(zlib1g-dev)
dpkg -s libjpeg62-turbo-dev >/dev/null 2>&1 || need_apt+=(libjpeg62-turbo-dev)  # crop decoding builds on it
dpkg -s libturbojpeg0 >/dev/null 2>&1 || need_apt+=(libturbojpeg0)  # PyTurboJPEG, compared in bench/loader.py
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pyok() { "$VENV/bin/python" -c "$1" >/dev/null 2>&1; }

pyok "import torch; assert torch.__version__.startswith('2.13.0')" || {
  echo "setup: torch 2.13.0 (CPU build)"; pip install -q --upgrade pip wheel setuptools; pip install -q torch==2.13.0; }

pip install -q -e ".[dev]"

# pillow-simd replaces Pillow under the same import name and is built from source. It goes in
# after the project's dependencies, since some of them (matplotlib) pull in stock Pillow.
pyok "import PIL; assert '.post' in PIL.__version__" || {
  echo "setup: pillow-simd (built from source)"
  pip uninstall -q -y pillow pillow-simd >/dev/null 2>&1 || true
  simd_cc=cc; grep -qw avx2 /proc/cpuinfo && simd_cc="cc -mavx2"
  CC="$simd_cc" pip install -q --no-deps --force-reinstall --no-binary pillow-simd pillow-simd; }

# Horovod 0.28.1 forces C++14 but torch >= 2.1 needs C++17: a cmake wrapper injects a
# project include that maps the C++14 flags to C++17 (see ../shared/notes/horovod.md).
pyok "import horovod.torch" || {
  echo "setup: horovod 0.28.1 (built against torch, ~5 min the first time)"
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
  HOROVOD_CMAKE="$hv/cmake" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
  HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=-j"$(nproc)" \
    pip install -q --no-build-isolation horovod==0.28.1
  rm -rf "$hv"; }
# Crop decoding (trainer/cropdecode.py): trainer/libcropjpeg.so from csrc/cropjpeg.c; rebuilt only
# when the source is newer. The trainer runs without it, decoding whole frames.
bash scripts/build-native.sh || echo "setup: crop decoding library not built: the trainer will decode whole frames"
echo "setup: done ($VENV)"
