"""What checking every sample's digest costs: the candidate hashes on clip-sized buffers, and the
reader's path with and without the check (``shards.read.reading.open_samples`` against a plain
``open_range`` of the same bytes), from the page cache, on one core.

    python bench/digest.py                  # 8 shards of 100 clips like bench/service.py's

Prints microseconds per clip for xxh3-64 (the manifest's, format /2), CRC32C (google-crc32c),
zlib's CRC-32 and SHA-256 on a 150 kB and a 480 kB clip, then the CPU time per clip of reading
every sample of the set checked and unchecked, and the difference: the cost per clip of the
check. The last line is ``BENCH_JSON {...}``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import google_crc32c  # noqa: E402
import xxhash  # noqa: E402

from bench.service import make_set  # noqa: E402
from shards.read.reading import open_range, open_samples  # noqa: E402

HASHES = {"xxh3-64": xxhash.xxh3_64_hexdigest, "crc32c": google_crc32c.value, "zlib crc32": zlib.crc32,
          "sha256": lambda d: hashlib.sha256(d).digest()}


def per_call_us(fn, data: bytes, repeat: int) -> float:
    best = float("inf")
    for _ in range(5):
        t = time.process_time()
        for _ in range(repeat):
            fn(data)
        best = min(best, (time.process_time() - t) / repeat)
    return best * 1e6


def read_all(m, checked: bool) -> float:
    """CPU seconds to read every sample of the set, one range per shard."""
    t = time.process_time()
    for s in m.splits["train"].shards:
        url, end = m.shard_url(s), s.offsets[-1] + s.lengths[-1]
        f = open_samples(url, s, 0, end) if checked else open_range(url, 0, end)
        with f:
            for n in s.lengths:
                f.read(n)
    return time.process_time() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/kinetics-fast-bench-digest", help="working directory (rebuilt)")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--clips", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5, help="reads of the set per variant (best taken)")
    args = p.parse_args()
    res = {"hash_us": {}}
    for size in (150_000, 480_000):
        data = os.urandom(size)
        res["hash_us"][size] = {name: per_call_us(fn, data, 200) for name, fn in HASHES.items()}
        print(f"{size // 1000} kB clip: " + ", ".join(f"{k} {v:.1f} us" for k,
                                                      v in res["hash_us"][size].items()))
    shutil.rmtree(args.out, ignore_errors=True)
    m = make_set(args.out, args.shards, args.clips)
    clips = args.shards * args.clips
    clip_kb = sum(s.bytes for s in m.splits["train"].shards) / clips / 1e3
    read_all(m, True)  # the page cache
    plain = min(read_all(m, False) for _ in range(args.rounds)) / clips * 1e6
    checked = min(read_all(m, True) for _ in range(args.rounds)) / clips * 1e6
    res.update({"clips": clips, "clip_kB": clip_kb, "read_unchecked_us_per_clip": plain,
                "read_checked_us_per_clip": checked, "check_us_per_clip": checked - plain})
    print(f"reading {clips} clips of {clip_kb:.0f} kB from the page cache: {plain:.1f} us per clip "
          f"unchecked, {checked:.1f} us checked: the check costs {checked - plain:.1f} us per clip")
    print("BENCH_JSON " + json.dumps(res, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
