#!/usr/bin/env bash
# Builds the crop-decoding library trainer/libcropjpeg.so from csrc/cropjpeg.c against the
# system's libjpeg-turbo (Debian: libjpeg62-turbo-dev). Idempotent: does nothing when the
# library is newer than its source. The trainer works without it (PIL decoding, logged).
set -euo pipefail
cd "$(dirname "$0")/.."
src=csrc/cropjpeg.c lib=trainer/libcropjpeg.so
[ "$lib" -nt "$src" ] && exit 0
tmp=$(mktemp "$lib.XXXXXX")
${CC:-cc} -O2 -Wall -Wextra -fPIC -shared -o "$tmp" "$src" -ljpeg
mv -f "$tmp" "$lib"  # atomic: a loader never sees a half-written library
echo "build-native: $lib"
