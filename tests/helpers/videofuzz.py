"""Test helper: seeded mutants of real small videos, and a contained runner for the parser campaign
of ``tests/test_video_fuzz.py``.

* ``boxes(data)`` walks an ISO-BMFF file's box tree: the containers ``ingest.decode.mp4header`` descends
  into, and the entries of the sample description. ``mutate(data, rng)`` makes one mutant of a file
  and names what it did (``Mutant.how``): bytes flipped, runs cut, inserted or duplicated; a box's
  size zeroed, scaled, set to 2^32-1, to a 64-bit 2^64-1, to a negative number as unsigned; a
  table's entry count, or an entry's sample count or delta, set huge; a header field set to an
  extreme; a cut at a box boundary. Files that are not MP4 (Matroska, WebM, AVI) get the byte
  mutations. ``truncations(data)`` is the file cut at every structural boundary, and
  ``nested(data, depth)`` a ``moov`` holding a ``trak`` nested ``depth`` deep.
* ``packet_mutants(packet, extradata, rng)`` does the same to one coded packet (and its stream's
  decoder configuration record): NAL length prefixes zeroed or made huge, start codes inserted.
* ``contained(check, cases)`` runs ``check(case)`` for every case in a forked child under an
  address-space limit (``RLIMIT_AS``), a time limit per case (``SIGALRM``: a guard that fails the
  case, not a measurement) and ``tracemalloc``, and returns one ``Outcome`` per case: the problem
  ``check`` reported, or the exception that escaped it, the time limit it ran past, or the signal
  that killed the child; and the case's peak of Python allocations. A child that dies is replaced
  by a fresh one for the cases after it.
"""
from __future__ import annotations

import json
import os
import random
import resource
import signal
import struct
import tracemalloc
from dataclasses import dataclass
from typing import Callable, Sequence

CONTAINERS = {b"moov", b"trak", b"edts", b"mdia", b"minf", b"stbl"}
SAMPLE_ENTRY_FIELDS = 78  # a visual sample entry's fields before its own boxes (avcC, pasp, ...)
COUNTED = {b"stts": 4, b"ctts": 4, b"elst": 4, b"stsc": 4, b"stco": 4, b"co64": 4, b"stss": 4, b"stsz": 8}
HEADERS = (b"mvhd", b"tkhd", b"mdhd", b"hdlr", b"stsd", b"pasp", b"avcC", b"hvcC", b"stsz")
EXTREMES = (0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF)


@dataclass(frozen=True)
class Box:
    path: str  # kinds from the top, "moov/trak/mdia/minf/stbl/stts"
    start: int  # offset of the size field
    header: int  # 8, or 16 with a 64-bit size
    end: int

    @property
    def body(self) -> int:
        return self.start + self.header


@dataclass(frozen=True)
class Mutant:
    how: str  # what was done, e.g. "set size of moov/trak to 0xffffffff"
    data: bytes


def boxes(data: bytes, start: int = 0, end: int | None = None, path: str = "") -> list[Box]:
    """Every box from ``start`` to ``end``, containers' children after them, in file order."""
    end = len(data) if end is None else end
    found, pos = [], start
    while pos + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, pos)
        header = 8
        if size == 1 and pos + 16 <= end:
            size, header = struct.unpack_from(">Q", data, pos + 8)[0], 16
        elif size == 0:
            size = end - pos
        if size < header or pos + size > end:
            break
        box = Box(f"{path}{kind.decode('latin-1')}", pos, header, pos + size)
        found.append(box)
        if kind in CONTAINERS:
            found += boxes(data, box.body, box.end, box.path + "/")
        elif kind == b"stsd":
            found += boxes(data, box.body + 8, box.end, box.path + "/")
        elif path.endswith("stsd/"):  # a sample entry: its fields, then boxes
            found += boxes(data, box.body + SAMPLE_ENTRY_FIELDS, box.end, box.path + "/")
        pos += size
    return found


def find(data: bytes, path: str) -> Box:
    """The first box at ``path`` ("moov/trak/mdia/minf/stbl/stts")."""
    return next(b for b in boxes(data) if b.path == path)


def put(data: bytes, offset: int, fmt: str, *values) -> bytes:
    """``data`` with ``values`` packed big-endian in ``fmt`` at ``offset``."""
    out = bytearray(data)
    struct.pack_into(">" + fmt, out, offset, *values)
    return bytes(out)


def is_mp4(data: bytes) -> bool:
    return data[4:8] == b"ftyp"


# --- byte mutations, for any file -----------------------------------------------------------------

def _run(data: bytes, rng: random.Random) -> tuple[int, int]:
    """A random run [at, at + n) of ``data`` (n >= 1)."""
    at = rng.randrange(len(data))
    return at, rng.randint(1, min(64, len(data) - at))


def _flip(data, rng, region):
    out, changed = bytearray(data), []
    for _ in range(rng.choice((1, 1, 2, 4, 8))):
        at = rng.randrange(*region)
        out[at] ^= rng.randint(1, 255)
        changed.append(at)
    return f"flip bytes at {sorted(changed)}", bytes(out)


def _cut(data, rng, region):
    at, n = _run(data, rng)
    return f"cut {n} bytes at {at}", data[:at] + data[at + n:]


def _insert(data, rng, region):
    at, n = rng.randrange(*region), rng.randint(1, 64)
    return f"insert {n} random bytes at {at}", data[:at] + rng.randbytes(n) + data[at:]


def _duplicate(data, rng, region):
    at, n = _run(data, rng)
    to = rng.randrange(len(data))
    return f"duplicate {n} bytes of {at} at {to}", data[:to] + data[at:at + n] + data[to:]


def _truncate(data, rng, region):
    at = rng.randrange(len(data))
    return f"truncate at {at}", data[:at]


BYTE_MUTATIONS = (_flip, _cut, _insert, _duplicate, _truncate)


# --- structural mutations, for MP4 ----------------------------------------------------------------

def _size(data, rng, tree):
    box = rng.choice(tree)
    size = box.end - box.start
    value = rng.choice((0, 1, 7, 8, size - 1, size + 1, size * 2, size // 2, 0xFFFFFFFF, 0x80000000,
                        -size & 0xFFFFFFFF, len(data) + 1)) & 0xFFFFFFFF
    if box.header == 16 or rng.random() < 0.2:  # a 64-bit size (over the first 8 bytes of its body)
        value = rng.choice((2**64 - 1, 2**63, size * 2, 0, 16, -size & (2**64 - 1)))
        return f"set 64-bit size of {box.path} to {value:#x}", put(put(data, box.start, "I", 1),
                                                                       box.start + 8, "Q", value)
    return f"set size of {box.path} to {value:#x}", put(data, box.start, "I", value)


def _count(data, rng, tree):
    tables = [b for b in tree if b.path[-4:].encode() in COUNTED and b.end - b.body >= 8]
    if not tables:
        return None
    box = rng.choice(tables)
    at = box.body + COUNTED[box.path[-4:].encode()]
    if at + 4 > box.end:
        return None
    count = struct.unpack_from(">I", data, at)[0]
    value = rng.choice((0, 1, count + 1, count * 1000 & 0xFFFFFFFF, 0x7FFFFFFF, 0xFFFFFFFF))
    return f"set entry count of {box.path} to {value:#x}", put(data, at, "I", value)


def _entry(data, rng, tree):
    """A field of one entry of a time table: a sample count, a delta, an edit's duration or rate."""
    tables = [b for b in tree if b.path[-4:] in ("stts", "ctts", "elst") and b.end - b.body >= 16]
    if not tables:
        return None
    box = rng.choice(tables)
    size = 20 if box.path.endswith("elst") and data[box.body] == 1 else 12 if box.path.endswith("elst") else 8
    entries = (box.end - box.body - 8) // size
    if entries < 1:
        return None
    at = box.body + 8 + rng.randrange(entries) * size + rng.randrange(0, size - 3, 4)
    value = rng.choice(EXTREMES + (0xFFFFFFFE, 1000000))
    return f"set u32 at {at} (an entry of {box.path}) to {value:#x}", put(data, at, "I", value)


def _field(data, rng, tree):
    heads = [b for b in tree if b.path[-4:].encode() in HEADERS and b.end - b.body >= 4]
    if not heads:
        return None
    box = rng.choice(heads)
    at = rng.randrange(box.body, box.end - 3)
    value = rng.choice(EXTREMES)
    return f"set u32 at {at} (in {box.path}) to {value:#x}", put(data, at, "I", value)


def _boundary(data, rng, tree):
    cuts = boundaries(tree)
    at = rng.choice(cuts)
    return f"truncate at {at} (a box boundary)", data[:at]


def _splice(data, rng, tree):
    """A box's bytes repeated in place: a second moov, a duplicated trak, two stts."""
    box = rng.choice(tree)
    times = rng.choice((2, 3, 50))
    return (f"repeat {box.path} {times} times",
            data[:box.start] + data[box.start:box.end] * times + data[box.end:])


MP4_MUTATIONS = (_size, _size, _count, _entry, _entry, _field, _boundary, _splice)


def boundaries(tree: Sequence[Box]) -> list[int]:
    """Offsets where a cut splits a box's structure: its start, inside its size and type, after
    its header, just before its end."""
    cuts = set()
    for b in tree:
        cuts |= {b.start, b.start + 4, b.body, b.body + 4, b.end - 1, b.end}
    return sorted(c for c in cuts if c > 0)


def truncations(data: bytes) -> list[Mutant]:
    """``data`` cut at every structural boundary of its boxes."""
    return [Mutant(f"truncate at {at} (a box boundary)", data[:at]) for at in boundaries(boxes(data))
            if at < len(data)]


def nested(data: bytes, depth: int) -> Mutant:
    """``data`` whose ``moov`` holds, before its own tracks, a ``trak`` nested ``depth`` deep
    (each a container of the next, sizes consistent): what recursion over boxes meets."""
    moov = find(data, "moov")
    inner = b""
    for _ in range(depth):
        inner = struct.pack(">I4s", 8 + len(inner), b"trak") + inner
    body = inner + data[moov.body:moov.end]
    head = struct.pack(">I4s", 8 + len(body), b"moov")
    return Mutant(f"a trak nested {depth} deep in moov", data[:moov.start] + head + body + data[moov.end:])


def mutate(data: bytes, rng: random.Random) -> Mutant:
    """One mutant of ``data``: one to three mutations, structural ones where it is an MP4."""
    hows, mp4 = [], is_mp4(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        if not data:
            break
        tree = boxes(data) if mp4 else []
        if tree and rng.random() < 0.6:
            done = rng.choice(MP4_MUTATIONS)(data, rng, tree)
        else:
            moov = next((b for b in tree if b.path == "moov"), None)
            region = (moov.start, moov.end) if moov and rng.random() < 0.7 else (0, len(data))
            done = rng.choice(BYTE_MUTATIONS)(data, rng, region)
        if done is not None:
            hows.append(done[0])
            data = done[1]
    return Mutant("; ".join(hows), data)


# --- packets ---------------------------------------------------------------------------------------

def packet_mutants(packet: bytes, extradata: bytes | None, rng: random.Random):
    """(how, packet, extradata): one mutant of a coded packet and its decoder configuration."""
    how = rng.choice(("bytes", "bytes", "length", "start code", "extradata", "tiny"))
    if how == "bytes" and packet:
        what, packet = rng.choice(BYTE_MUTATIONS[:4])(packet, rng, (0, len(packet)))
        return what, packet, extradata
    if how == "length" and len(packet) >= 4:
        value = rng.choice((0, 1, 2, 0xFFFFFFFF, 0x7FFFFFFF, len(packet)))
        at = rng.randrange(0, len(packet) - 3)
        return f"set u32 at {at} of the packet to {value:#x}", put(packet, at, "I", value), extradata
    if how == "start code":
        at = rng.randrange(len(packet) + 1)
        code = rng.choice((b"\0\0\1", b"\0\0\0\1", b"\0\0\1\xb6", b"\0\0\1" * 100))
        return f"insert start code {code[:4].hex()} at {at}", packet[:at] + code + packet[at:], extradata
    if how == "extradata":
        choice = rng.choice(("none", "empty", "first byte", "length size", "cut"))
        data = bytearray(extradata or b"")
        if choice == "first byte" and data:
            data[0] = rng.choice((0, 2, 255))
        elif choice == "length size" and len(data) >= 22:
            data[rng.choice((4, 21))] ^= rng.randint(1, 3)
        elif choice == "cut":
            data = data[:rng.randrange(len(data) + 1)]
        extradata = None if choice == "none" else b"" if choice == "empty" else bytes(data)
        return f"extradata: {choice}", packet, extradata
    size = rng.choice((0, 1, 2, 3, 4, 5))
    return f"the packet's first {size} bytes only", packet[:size], extradata


# --- the contained runner --------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    problem: str | None  # None: the property held
    peak: int  # bytes: the largest Python allocation total while the case ran


class OverTime(BaseException):
    """The case ran past its time limit (BaseException: no ``except Exception`` in the code under
    test swallows it)."""


def _over_time(signum, frame):
    raise OverTime


def _vm_size() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def _child(check, cases, first: int, out: int, limit_s: float, headroom: int) -> None:
    limit = _vm_size() + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    signal.signal(signal.SIGALRM, _over_time)
    tracemalloc.start()
    for i in range(first, len(cases)):
        tracemalloc.reset_peak()
        try:
            signal.setitimer(signal.ITIMER_REAL, limit_s)
            problem = check(cases[i])
        except OverTime:
            problem = f"ran past the {limit_s:g} s limit"
        except BaseException as e:  # noqa: B902 - what escapes is the finding
            problem = f"{type(e).__name__} escaped: {e}"[:300]
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        peak = tracemalloc.get_traced_memory()[1]
        os.write(out, (json.dumps([i, problem, peak]) + "\n").encode())
    os._exit(0)


def contained(check: Callable[[object], str | None], cases: Sequence, *, limit_s: float = 5.0,
              headroom: int = 512 << 20) -> list[Outcome]:
    """``check(case)`` for every case in forked children, each under an address space of its size
    at the fork plus ``headroom`` bytes and ``limit_s`` seconds a case."""
    outcomes: list[Outcome | None] = [None] * len(cases)
    first = 0
    while first < len(cases):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                _child(check, cases, first, w, limit_s, headroom)
            finally:
                os._exit(70)
        os.close(w)
        with os.fdopen(r) as lines:
            for line in lines:
                i, problem, peak = json.loads(line)
                outcomes[i] = Outcome(problem, peak)
                first = i + 1
        _, status = os.waitpid(pid, 0)
        if first < len(cases) and outcomes[first] is None:  # the child died in this case
            outcomes[first] = Outcome(f"the child died ({_death(status)})", 0)
            first += 1
    return outcomes


def _death(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.WEXITSTATUS(status)}"
