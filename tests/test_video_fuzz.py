"""A seeded mutation campaign over the parsers of untrusted video bytes written in Python
(``ingest.decode.mp4header``, ``ingest.decode.bitstream``, ``ingest.decode.packets``), on real small videos.

In-process, each mutant runs in a forked child under an address-space limit and a time limit
per case (``videofuzz.contained``). The properties: ``mp4header.read`` returns sound header facts
or None (ffprobe is asked instead); a ``bitstream`` parser classifies any packet; ``packets``
orders what timestamps can order and plans exactly the packets a full decode needs; none raises,
none runs past the limit, none allocates more than a small multiple of its input. Then mutants of
every container go through the real ``ingest build``: each ends as one ledger line or as a good
clip, with no traceback. The mutants that found bugs are regression tests below, remade from
what was done to which box. ``docs/benchmarks/fuzz-video.md`` has the campaign's numbers.
"""
from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import random
import resource
import subprocess
import sys
import tarfile
from pathlib import Path

import av
import pytest
from helpers import media, videofuzz
from helpers.videofuzz import Mutant, find, put
from PIL import Image

from ingest.clips import ClipConfig, make_clips
from ingest.decode import bitstream, mp4header, packets
from ingest.decode.video import DecodeError
from ingest.sources import Video

MP4S = {
    "h264.mp4": lambda p: media.make_video(p, frames=24),  # x264's defaults: B-frames, so a ctts
    "edit_list.mp4": media.make_edit_list,
    "hevc.mp4": media.make_hevc_mp4,
    "rotated.mp4": media.make_rotated,
    "anamorphic.mp4": media.make_anamorphic,
    "no_edit_list.mp4": lambda p: media.make_video(p, frames=24, extra_output_args={"use_editlist": 0}),
}
OTHERS = {
    "h264.mkv": media.make_mkv,
    "vp9.webm": media.make_vp9_webm,
    "mpeg4.avi": media.make_mpeg4_avi,
    "annexb.ts": lambda p: media.make_video(p, frames=24, extra_output_args={"format": "mpegts"}),
}
STBL = "moov/trak/mdia/minf/stbl"
MUTANTS_PER_MP4 = 100  # 600 in all, and each file cut at every box boundary
CASES_PER_PARSER = 600
LONG_FACTOR = 40
DECODER_MUTANTS_LONG = 600


def memory_bound(input_size: int) -> int:
    """The most Python allocations one case may make: a small multiple of its input."""
    return 8 * input_size + (256 << 10)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("fuzz-sources")
    return {name: make(root / name).read_bytes() for name, make in {**MP4S, **OTHERS}.items()}


@pytest.fixture(scope="module")
def streams(sources, tmp_path_factory) -> dict[str, tuple[str, bytes | None, list]]:
    """name -> (codec, extradata, [(packet bytes, pts, discard)]) of each source's video stream."""
    root = tmp_path_factory.mktemp("fuzz-streams")
    found = {}
    for name, data in sources.items():
        (root / name).write_bytes(data)
        with av.open(str(root / name)) as c:
            s = c.streams.video[0]
            found[name] = (s.codec_context.name, s.codec_context.extradata,
                           [(bytes(p), p.pts, p.is_discard) for p in c.demux(s) if p.size])
    return found


# --- mp4header ------------------------------------------------------------------------------------

def header_problem(path: Path, mutant: Mutant) -> str | None:
    """None when ``mp4header.read`` of the mutant is None or sound facts; else what is wrong."""
    path.write_bytes(mutant.data)
    head = mp4header.read(str(path))
    if head is None:
        return None
    if head.num_frames < 1 or head.width < 1 or head.height < 1 or head.num_frames > len(mutant.data):
        return f"unsound header facts {head}"
    if not all(math.isfinite(x) and x >= 0 for x in (head.fps, head.duration, head.sar)):
        return f"unsound header facts {head}"
    if head.codec not in mp4header.CODECS.values() or not 0 <= head.rotation < 360:
        return f"unsound header facts {head}"
    return None


def check_headers(tmp_path: Path, cases: list[Mutant]) -> None:
    outcomes = videofuzz.contained(functools.partial(header_problem, tmp_path / "case.mp4"), cases)
    failed = [f"{m.how}: {o.problem}" for m, o in zip(cases, outcomes) if o.problem]
    greedy = [f"{m.how}: {o.peak} bytes for {len(m.data)}" for m, o in zip(cases, outcomes)
              if not o.problem and o.peak > memory_bound(len(m.data))]
    assert not failed, f"{len(failed)} of {len(cases)} mutants:\n" + "\n".join(failed[:20])
    assert not greedy, "\n".join(greedy[:20])


def header_mutants(sources, per_file: int) -> list[Mutant]:
    """``per_file`` seeded mutants of each MP4, and each cut at every box boundary."""
    cases = []
    for name in MP4S:
        data = sources[name]
        cases += [Mutant(f"{name} seed {seed}: " + m.how, m.data)
                  for seed in range(per_file)
                  for m in [videofuzz.mutate(data, random.Random(f"{name}:{seed}"))]]
        cases += [Mutant(f"{name}: {m.how}", m.data) for m in videofuzz.truncations(data)]
    return cases


def test_the_real_files_are_read_and_each_box_is_found(sources, tmp_path):
    for name in MP4S:
        assert header_problem(tmp_path / name, Mutant("none", sources[name])) is None
        assert mp4header.read(str(tmp_path / name)) is not None
        tree = {b.path for b in videofuzz.boxes(sources[name])}
        assert {"moov", f"{STBL}/stts", f"{STBL}/stsz", "moov/trak/tkhd"} <= tree, name
    assert f"{STBL}/ctts" in {b.path for b in videofuzz.boxes(sources["h264.mp4"])}
    assert "moov/trak/edts/elst" in {b.path for b in videofuzz.boxes(sources["edit_list.mp4"])}


def test_mutated_mp4_headers_are_read_soundly_or_left_to_ffprobe(sources, tmp_path):
    cases = header_mutants(sources, MUTANTS_PER_MP4)
    assert len(cases) >= 500 + len(MP4S) * 60
    check_headers(tmp_path, cases)


@pytest.mark.long
def test_mutated_mp4_headers_long(sources, tmp_path):
    check_headers(tmp_path, header_mutants(sources, MUTANTS_PER_MP4 * LONG_FACTOR))


def stts_count(data: bytes, value: int, table: str = "stts") -> Mutant:
    """The first entry's sample count of ``table`` set to ``value``."""
    box = find(data, f"{STBL}/{table}")
    return Mutant(f"{table} entry 0 sample count {value:#x}", put(data, box.body + 8, "I", value))


def sample_count(data: bytes, value: int) -> Mutant:
    """The sample count of ``stsz`` set to ``value``."""
    return Mutant(f"stsz sample count {value:#x}", put(data, find(data, f"{STBL}/stsz").body + 8, "I", value))


def hidden_by_the_edit(data: bytes) -> Mutant:
    """The edit list's one edit starting (media time) after every sample: it shows none."""
    box = find(data, "moov/trak/edts/elst")
    return Mutant("elst media time 0x7fffffff", put(data, box.body + 8 + 4, "i", 0x7FFFFFFF))


@pytest.mark.parametrize("build", [
    # found by the campaign: the stts and ctts runs were expanded into a list of every sample
    # (2^32 of them: a MemoryError, or past the time limit)
    lambda s: stts_count(s["edit_list.mp4"], 0xFFFFFFFF),
    lambda s: stts_count(s["edit_list.mp4"], 0x80000000),
    lambda s: stts_count(s["edit_list.mp4"], 0xFFFFFFFF, "ctts"),
    # the boxes were walked by recursion: a RecursionError
    lambda s: videofuzz.nested(s["h264.mp4"], 2000),
    # an edit list showing no sample was a header of 0 frames (sampling raised ValueError)
    lambda s: hidden_by_the_edit(s["edit_list.mp4"]),
    # a sample count that no file of this size holds was trusted (4294967295 frames)
    lambda s: sample_count(s["no_edit_list.mp4"], 0xFFFFFFFF),
], ids=["stts-count-2^32-1", "stts-count-2^31", "ctts-count-2^32-1", "trak-nested-2000-deep",
        "edit-shows-nothing", "stsz-count-2^32-1"])
def test_mp4_mutants_that_found_bugs_are_left_to_ffprobe(sources, tmp_path, build):
    mutant = build(sources)
    path = tmp_path / "case.mp4"

    def check(m):
        path.write_bytes(m.data)
        head = mp4header.read(str(path))
        return None if head is None else f"read as {head}"

    outcome, = videofuzz.contained(check, [mutant])
    assert outcome.problem is None, f"{mutant.how}: {outcome.problem}"


def test_the_deepest_real_nesting_is_still_read(sources, tmp_path):
    """Boxes nested as deep as the tracks of a real file are read; the refusal is for depth no
    file has (the nested trak above is empty: the real track after it is the one read)."""
    path = tmp_path / "nested.mp4"
    path.write_bytes(videofuzz.nested(sources["h264.mp4"], 3).data)
    assert mp4header.read(str(path)).num_frames == 24


# --- bitstream ------------------------------------------------------------------------------------

def packet_cases(streams, count: int, seed: int = 0) -> list[tuple[str, str, bytes, bytes | None]]:
    """(how, codec, packet, extradata): mutants of the real packets of every source's stream."""
    rng, cases = random.Random(seed), []
    names = sorted(streams)
    while len(cases) < count:
        name = rng.choice(names)
        codec, extradata, coded = streams[name]
        packet = rng.choice(coded)[0]
        how, packet, extra = videofuzz.packet_mutants(packet, extradata, rng)
        cases.append((f"{name}: {how}", codec, packet, extra))
    return cases


def coded_problem(case) -> str | None:
    _, codec, packet, extradata = case
    size = bitstream.length_size(codec, extradata)
    if size not in (None, 1, 2, 3, 4):
        return f"length size {size}"
    coded = bitstream.parser(codec, extradata)(packet)
    if not isinstance(coded, bitstream.Coded) or not isinstance(coded.reference, bool):
        return f"not a classification: {coded!r}"
    if not isinstance(coded.barrier, bool) or not -1 <= coded.layer <= 6:
        return f"not a classification: {coded!r}"
    return None


def check_packets_parse(cases) -> None:
    outcomes = videofuzz.contained(coded_problem, cases)
    failed = [f"{c[0]}: {o.problem}" for c, o in zip(cases, outcomes) if o.problem]
    greedy = [f"{c[0]}: {o.peak} bytes for {len(c[2])}" for c, o in zip(cases, outcomes)
              if not o.problem and o.peak > memory_bound(len(c[2]) + len(c[3] or b""))]
    assert not failed, f"{len(failed)} of {len(cases)} packets:\n" + "\n".join(failed[:20])
    assert not greedy, "\n".join(greedy[:20])


def test_mutated_packets_of_every_codec_are_classified(streams):
    assert {c for c, _, _ in streams.values()} == {"h264", "hevc", "mpeg4", "vp9"}
    check_packets_parse(packet_cases(streams, CASES_PER_PARSER))


@pytest.mark.long
def test_mutated_packets_long(streams):
    check_packets_parse(packet_cases(streams, CASES_PER_PARSER * LONG_FACTOR, seed=1))


# --- packets --------------------------------------------------------------------------------------

def _changed(index: list[packets.Packet], at: int, **change) -> list[packets.Packet]:
    return [dataclasses.replace(p, **change) if k == at else p for k, p in enumerate(index)]


INDEX_MUTATIONS = {
    "pts none": lambda index, at, rng: _changed(index, at, pts=None),
    "pts repeated": lambda index, at, rng: _changed(index, at, pts=rng.choice(index).pts),
    "pts huge": lambda index, at, rng: _changed(index, at, pts=2**63 - 1),
    "pts negative": lambda index, at, rng: _changed(index, at, pts=-2**63),
    "discard flipped": lambda index, at, rng: _changed(index, at, discard=not index[at].discard),
    "barrier flipped": lambda index, at, rng: _changed(index, at, barrier=not index[at].barrier),
    "reference flipped": lambda index, at, rng: _changed(index, at, reference=not index[at].reference),
    "cut after": lambda index, at, rng: index[:at + 1],
    "reversed": lambda index, at, rng: index[::-1],
    "all barriers": lambda index, at, rng: [dataclasses.replace(p, barrier=True) for p in index],
    "all discarded": lambda index, at, rng: [dataclasses.replace(p, discard=True) for p in index],
}


def index_cases(streams, count: int, seed: int = 0) -> list[tuple[str, list[packets.Packet], set[int]]]:
    """(how, index, picks): each source's packet index (as ``pyav_decoder`` makes it), mutated:
    timestamps missing, repeated, reversed, huge or negative; flags set or cleared; truncated."""
    rng, cases = random.Random(seed), []
    names = sorted(streams)
    while len(cases) < count:
        name = rng.choice(names)
        codec, extradata, coded = streams[name]
        parse = bitstream.parser(codec, extradata)
        index = [packets.Packet(pts, discard, parse(data).reference, parse(data).barrier)
                 for data, pts, discard in coded]
        hows = []
        for _ in range(rng.randint(1, 3)):
            what, i = rng.choice(sorted(INDEX_MUTATIONS)), rng.randrange(len(index))
            index = INDEX_MUTATIONS[what](index, i, rng)
            hows.append(f"{what} at {i}")
        shown = packets.displayed(index)
        pool = shown if shown else list(range(len(index)))
        picks = set(rng.sample(pool, min(len(pool), rng.choice((1, 8, 16)))))
        cases.append((f"{name}: {', '.join(hows)}", index, picks))
    return cases


def index_problem(case) -> str | None:
    """None when ``displayed`` orders the shown packets by pts (or refuses what pts cannot order)
    and ``plan`` feeds exactly the references each pick needs since the barrier before it."""
    _, index, picks = case
    order = packets.displayed(index)
    shown = [i for i, p in enumerate(index) if not p.discard]
    pts = [index[i].pts for i in shown]
    if order is None:
        if None not in pts and len(set(pts)) == len(pts):
            return "refused timestamps that order the frames"
    elif sorted(order) != shown or [index[i].pts for i in order] != sorted(pts):
        return f"display order {order} is not the pts order"
    feed = packets.plan(index, picks)
    needed = set()
    for p in picks:
        since = max((i for i in range(1, p + 1) if index[i].barrier), default=0)
        needed |= {i for i in range(since, p + 1) if index[i].reference or i in picks}
    if feed != sorted(needed):
        return f"plan {feed} is not the packets the picks need, {sorted(needed)}"
    return None


def check_indexes(cases) -> None:
    outcomes = videofuzz.contained(index_problem, cases)
    failed = [f"{c[0]}: {o.problem}" for c, o in zip(cases, outcomes) if o.problem]
    assert not failed, f"{len(failed)} of {len(cases)} indexes:\n" + "\n".join(failed[:20])


def test_mutated_packet_indexes_are_ordered_and_planned_exactly(streams):
    check_indexes(index_cases(streams, CASES_PER_PARSER))


@pytest.mark.long
def test_mutated_packet_indexes_long(streams):
    check_indexes(index_cases(streams, CASES_PER_PARSER * LONG_FACTOR, seed=1))


# --- the decoders, on what the parsers give them -------------------------------------------------

def make(tmp_path: Path, name: str, data: bytes, decoder: str) -> list:
    """``make_clips`` of a video of these bytes (DecodeError: its one ledger reason)."""
    path = tmp_path / "val" / "a" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    video = Video("val", f"val/a/{name}", str(path), "a", path.stem, len(data))
    return make_clips(video, 0, ClipConfig(short_side=32, decoder=decoder), timeout=60)


def members(sample: bytes) -> list[tuple[str, bytes]]:
    """(member, bytes) of one sample's tar bytes."""
    with tarfile.open(fileobj=io.BytesIO(sample)) as tf:
        return [(info.name.split(".", 1)[1], tf.extractfile(info).read()) for info in tf]


def decoded_size(jpeg: bytes) -> tuple[int, int]:
    image = Image.open(io.BytesIO(jpeg))
    image.load()
    return image.size


def good_clip(sample: dict[str, bytes]) -> str | None:
    """None when a sample holds 8 JPEG frames that decode, of one size, and its meta; else why not."""
    frames = [sample.get(f"{t:02d}.jpg") for t in range(8)]
    if None in frames or "json" not in sample:
        return f"members {sorted(sample)}"
    sizes = {decoded_size(f) for f in frames}
    meta = json.loads(sample["json"])
    if len(sizes) != 1 or meta["num_frames"] < 1 or list(sizes)[0] != tuple(meta["frame_size"]):
        return f"frames of sizes {sizes}, meta {meta}"
    return None


def pasp(data: bytes, h: int, v: int) -> bytes:
    box = find(data, "moov/trak/mdia/minf/stbl/stsd/avc1/pasp")
    return put(data, box.body, "II", h, v)


def cut_inside(data: bytes, path: str) -> bytes:
    """``data`` cut between the size and the type of the box at ``path``."""
    return data[:find(data, path).start + 4]


def not_utf8(data: bytes) -> bytes:
    """A Matroska file whose encoder tag (``Lavc...``) starts with a byte UTF-8 cannot begin."""
    at = data.index(b"Lavc")
    return data[:at] + b"\xea" + data[at + 1:]


@pytest.mark.parametrize("decoder", ["pyav", "ffmpeg"])
@pytest.mark.parametrize("spacing", [(0x7FFFFFFF, 1), (1, 0x7FFFFFFF), (1000, 1)],
                         ids=["wide", "narrow", "x1000"])
def test_a_damaged_sample_aspect_ratio_is_one_ledger_reason(sources, tmp_path, decoder, spacing):
    """Found by the campaign: a pasp box's spacing flipped to 2^31-1 made a frame of display width
    0 (ZeroDivisionError in the in-process decoder; the command line's path took it for square)
    or 2^31 times the coded width (OverflowError scaling to it); 1000 times, a frame 341,333
    pixels wide at the default short side, which swscale refuses (an FFmpeg error escaping the
    in-process decoder; "ffmpeg failed to decode" from the command line). Now one reason, before
    anything is scaled."""
    reason = r"^implausible display size: \d+x48 from 64x48 coded at sample aspect ratio"
    with pytest.raises(DecodeError, match=reason):
        make(tmp_path, "v.mp4", pasp(sources["anamorphic.mp4"], *spacing), decoder)


DECODER_FINDS = {
    # a file cut inside minf before its sample tables: PyAV lists a video stream with no codec
    # context (AttributeError)
    "sample-tables-cut": (lambda s: cut_inside(s["edit_list.mp4"], "moov/trak/mdia/minf/dinf"),
                          "^(not a readable video|video stream has no frame size)"),
    # a stream tag that is not UTF-8: PyAV decodes tags strictly as it opens (UnicodeDecodeError)
    "tag-not-utf8": (lambda s: not_utf8(s["h264.mkv"]), None),
    # an edit list showing none of the frames: the command line's recount found 0 frames and
    # sampled from them (ValueError)
    "edit-shows-nothing": (lambda s: hidden_by_the_edit(s["h264.mp4"]).data,
                           "^(no frame decodes|video stream has no frames)$"),
}


@pytest.mark.parametrize("decoder", ["pyav", "ffmpeg"])
@pytest.mark.parametrize("find_", sorted(DECODER_FINDS))
def test_decoder_mutants_that_found_bugs_end_in_one_reason_or_good_clips(sources, tmp_path, decoder, find_):
    """Found by the campaign through the decoders, each an ``unexpected ...`` ledger line before;
    now one reason (the pattern), or good clips (None)."""
    build, reason = DECODER_FINDS[find_]
    if reason is None:
        clips, _ = make(tmp_path, f"{find_}.mkv", build(sources), decoder)
        assert len(clips) == 1 and good_clip(dict(members(clips[0][2]))) is None
    else:
        with pytest.raises(DecodeError, match=reason):
            make(tmp_path, f"{find_}.mp4", build(sources), decoder)


def decoder_end(root: Path, name: str, mutant: Mutant, decoder: str) -> str | None:
    """None when ``make_clips`` of the mutant makes good clips or raises DecodeError; else what it did."""
    try:
        clips, _ = make(root, name, mutant.data, decoder)
    except DecodeError:
        return None
    except Exception as e:  # noqa: B902 - what escapes is the finding
        return f"{type(e).__name__}: {e}"
    return next((why for *_, data in clips if (why := good_clip(dict(members(data))))), None)


@pytest.mark.long
@pytest.mark.parametrize("decoder", ["pyav", "ffmpeg"])
def test_mutated_videos_through_the_decoders_long(sources, tmp_path, decoder):
    """Mutants of every container through ``make_clips`` in-process (what found the bugs above)."""
    rng, names = random.Random(12), sorted(sources)
    failed = []
    for k in range(DECODER_MUTANTS_LONG):
        name = names[k % len(names)]
        mutant = videofuzz.mutate(sources[name], rng)
        if why := decoder_end(tmp_path, f"m{k:03d}_{name}", mutant, decoder):
            failed.append(f"m{k:03d}_{name}: {mutant.how}: {why}")
    assert not failed, "\n".join(failed[:20])


# --- through ingest build -------------------------------------------------------------------------

BUILD_MUTANTS = 28
BUILD_TIMEOUT_S = 20
BUILD_MEMORY = 8 << 30  # address space of the build and of each process it starts: a blow-up fails a video


def build_mutants(sources) -> dict[str, Mutant]:
    """relpath -> mutant: byte and structural mutants of every container, and the regressions."""
    found, names, rng = {}, sorted(sources), random.Random(7)
    for k in range(BUILD_MUTANTS):
        name = names[k % len(names)]
        found[f"val/{Path(name).suffix[1:]}/m{k:02d}_{name}"] = videofuzz.mutate(sources[name], rng)
    found["val/mp4/stts_huge.mp4"] = stts_count(sources["edit_list.mp4"], 0xFFFFFFFF)
    found["val/mp4/nested.mp4"] = videofuzz.nested(sources["h264.mp4"], 2000)
    found["val/mp4/hidden.mp4"] = hidden_by_the_edit(sources["edit_list.mp4"])
    found["val/mp4/pasp_wide.mp4"] = Mutant("pasp 2^31-1:1", pasp(sources["anamorphic.mp4"], 0x7FFFFFFF, 1))
    return found


def limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (BUILD_MEMORY, BUILD_MEMORY))


@pytest.mark.parametrize("decoder", ["pyav", "ffmpeg"])
def test_mutated_videos_through_ingest_build_end_in_a_ledger_line_or_a_good_clip(sources, tmp_path, decoder):
    """28 seeded mutants of the ten real files and the four regressions above, in one real build
    (``--timeout 20``, an address-space limit on every process): each ends as one ledger line of
    a reason of the decoders' own (not ``unexpected ...``) or as a clip of 8 frames that decode,
    never both; the command exits 0 or 1 without a traceback."""
    mutants = build_mutants(sources)
    src, out = tmp_path / "src", tmp_path / "out"
    for rel, m in mutants.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(m.data)
    p = subprocess.run([sys.executable, "-m", "ingest", "build", "--src", str(src), "--out", str(out),
                        "--short-side", "32", "--workers", "2", "--decoder", decoder, "--splits", "val",
                        "--timeout", str(BUILD_TIMEOUT_S), "--max-error-fraction", "1"],
                       capture_output=True, text=True, timeout=BUILD_TIMEOUT_S * len(mutants),
                       preexec_fn=limit_memory)
    assert p.returncode in (0, 1) and "Traceback" not in p.stderr, p.stderr[-3000:]
    ledger = {e["path"]: e for e in map(json.loads, (out / "errors.jsonl").read_text().splitlines())}
    clips = {}
    for shard in sorted((out / "val").glob("*.tar")):
        with tarfile.open(shard) as tf:
            for info in tf:
                key, member = info.name.split(".", 1)
                clips.setdefault(key, {})[member] = tf.extractfile(info).read()
    ended = {}
    for rel, m in mutants.items():
        key = f"{Path(rel).stem}_c00"
        if rel in ledger:
            reason = ledger[rel]["reason"]
            ended[rel] = reason if reason.startswith("unexpected") else "ledger"
            if key in clips:
                ended[rel] = f"a ledger line ({reason}) and a clip"
        elif key in clips:
            ended[rel] = good_clip(clips[key]) or "clip"
        else:
            ended[rel] = "neither a ledger line nor a clip"
    wrong = {rel: f"{mutants[rel].how}: {end}" for rel, end in ended.items() if end not in ("ledger", "clip")}
    assert not wrong, json.dumps(wrong, indent=1)
    assert {"ledger", "clip"} <= set(ended.values())
    assert ended["val/mp4/pasp_wide.mp4"] == "ledger"
    assert ledger["val/mp4/pasp_wide.mp4"]["reason"].startswith("implausible display size")
