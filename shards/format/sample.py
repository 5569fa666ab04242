"""The members of one sample: what a shard's sample may hold, what each means, and the one parser
every reader uses.

A sample is a run of consecutive regular-file tar members named ``<key>.<suffix>`` (WebDataset's
grouping rule: the key is everything before the first dot of the last path part). The suffixes
a sample may hold, and nothing else:

==================  ==================================================================
``NN.jpg``          frame ``NN`` (two digits, from 00) of the clip, JPEG, in temporal order
``NN.<kind>.png``   the motion field of frame ``NN`` (``shards.format.motionfield``), one per
                    frame when the set stores motion of that kind (``Manifest.motion``)
``cls``             the class index as ASCII decimal; present exactly when the manifest's
                    label of the sample is not -1, and equal to it
``json``            the clip's metadata: a JSON object (``Sample.meta``)
==================  ==================================================================

``pack`` writes a sample (ingest's packer); ``parse`` reads one from its bytes as the manifest
places them (verify, stats, preview, reshard, the clip index, the loader's stages, the viewer,
the service). ``parse`` is strict where tar readers are lenient: each header is checked against
the bytes the manifest gives the sample before anything is taken from it (a member claiming more
than is there, a zero block inside the range, a symlink, hard link or directory, a name outside
the key or the schema, a duplicate), so a reader never allocates from a header's claim and never
follows a link. Its refusal is ``BadSample``, one line naming the sample and the reason; readers
that go on without bad samples count it as they count a digest that differs.

Adding a field is one edit here: its suffix in ``pack``, its rule in ``_suffix_kind``, and a
field of ``Sample``.
"""
from __future__ import annotations

import io
import json
import re
import struct
import tarfile
from dataclasses import dataclass, field

from PIL import Image

from ..base.errors import DataFault
from ..base.words import shown
from . import motionfield
from .tar import BLOCK, member_bytes

FRAME = re.compile(r"(\d{2})\.jpg")
FIELD = re.compile(r"(\d{2})\.(" + "|".join(motionfield.KINDS) + r")\.png")
LABEL = "cls"
META = "json"
MAX_FRAMES = 100  # two digits
MAX_META_BYTES = 1 << 20  # a clip's metadata is a few hundred bytes
_REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE)
_KINDS = {tarfile.SYMTYPE: "symbolic link", tarfile.LNKTYPE: "hard link", tarfile.DIRTYPE: "directory",
          tarfile.CHRTYPE: "character device", tarfile.BLKTYPE: "block device", tarfile.FIFOTYPE: "FIFO",
          tarfile.CONTTYPE: "contiguous file", tarfile.XHDTYPE: "pax header",
          tarfile.XGLTYPE: "pax global header"}


class BadSample(DataFault):
    """A sample whose members are not what the format allows: ``key`` and ``why`` (without the
    place; ``where`` names the shard and URL). One line: ``WHERE: sample KEY: WHY``."""

    @classmethod
    def of(cls, where: str, key: str, why: str) -> "BadSample":
        return cls(f"{where}: sample {key}: {why}", where=where, key=key, why=why)


@dataclass
class Sample:
    """One parsed sample. ``frames``: JPEG bytes in frame order; ``fields``: the motion PNGs in
    frame order (empty without motion); ``label``: the class index, -1 when unlabelled;
    ``spans``: (offset, size) of each frame's bytes within the sample's bytes (a frame can be
    served from its shard without a copy)."""
    key: str
    frames: list = field(default_factory=list)
    fields: list = field(default_factory=list)
    label: int = -1
    meta_bytes: bytes = b""
    spans: list[tuple[int, int]] = field(default_factory=list)
    where: str = ""

    def meta(self) -> dict:
        """The metadata as a dict; a ``BadSample`` when it is not a small JSON object."""
        return parse_meta(self.meta_bytes, self.where, self.key)

    def frame_sizes(self) -> list[tuple[int, int]]:
        """Each frame's (width, height) from its JPEG header, read without decoding the picture: a
        ``BadSample`` when a header does not parse or is not a JPEG's. Every reader takes the sizes
        from here or ``jpeg_size`` (verify included, with or without ``--deep``), so a header a reader
        refuses, verify refuses first."""
        try:
            return [jpeg_size(jpeg) for jpeg in self.frames]
        except BadSample as e:
            raise BadSample.of(self.where, self.key, e.why) from None

    def pictures(self) -> list:
        """Each frame decoded whole, as an RGB ``PIL.Image``: a ``BadSample`` when one does not decode."""
        out = []
        for t, jpeg in enumerate(self.frames):
            try:
                with Image.open(io.BytesIO(jpeg)) as im:
                    out.append(im.convert("RGB"))
            except DECODE_ERRORS as e:
                raise BadSample.of(self.where, self.key,
                                   f"frame {t:02d} does not decode ({type(e).__name__}: {e})") from None
        return out


# What PIL (and the trainer's cropdecode) raise on bytes that are not a JPEG they can decode.
DECODE_ERRORS = (OSError, ValueError, SyntaxError, IndexError, struct.error, EOFError,
                 Image.DecompressionBombError)


def jpeg_size(jpeg) -> tuple[int, int]:
    """(width, height) from a frame's JPEG header, without decoding; a header that does not parse, or
    a picture of another format, is a ``BadSample`` without its place (``BadSample.of`` adds it)."""
    try:
        with Image.open(io.BytesIO(jpeg)) as im:
            kind, size = im.format, im.size
    except Image.UnidentifiedImageError:  # its message names the BytesIO object
        why = "a frame's bytes are no picture: its JPEG header does not parse"
        raise BadSample(why, why=why) from None
    except DECODE_ERRORS as e:
        why = f"a frame's JPEG header does not parse ({type(e).__name__}: {e})"
        raise BadSample(why, why=why) from None
    if kind != "JPEG":
        why = f"a frame is a {kind} picture, not a JPEG"
        raise BadSample(why, why=why)
    return size


def clip_key(video: str, clip: int) -> str:
    """The key of clip ``clip`` of ``video`` (ingest's ``--clips-per-video``): ``<video>_c<NN>``."""
    return f"{video}_c{clip:02d}"


def video_of(key: str) -> str:
    """``<video>_c<NN>`` -> ``<video>``: the clips of one video share it (a key of another form is a
    video of its own)."""
    return key.rsplit("_c", 1)[0]


def pack(key: str, frames: list[bytes], label: int, meta: dict, fields: list[bytes] = (),
         motion: str = "none") -> bytes:
    """One sample's tar bytes, its members in the schema's order: frames, motion fields, label, meta."""
    if "." in key or "/" in key:
        raise ValueError(f"sample key {key!r} must not contain '.' or '/'")
    members = [(f"{t:02d}.jpg", f) for t, f in enumerate(frames)]
    members += [(motionfield.member(t, motion), f) for t, f in enumerate(fields)]
    if label >= 0:
        members.append((LABEL, str(label).encode()))
    members.append((META, json.dumps(meta, sort_keys=True).encode()))
    return b"".join(member_bytes(f"{key}.{suffix}", data) for suffix, data in members)


def parse(data, key: str, *, label: int = -1, frames: int | None = None, motion: str = "none",
          where: str = "") -> Sample:
    """The sample ``key`` from its bytes (exactly the manifest's range of it: ``bytes`` or a
    ``memoryview``, whose members are views, not copies), checked against the schema: ``frames``
    frames (None: as many as there are, at least one, numbered from 00 without a gap), a
    ``motion`` field beside each (``Manifest.motion``), ``label`` (the manifest's) in ``cls``, a
    ``json`` member. Raises ``BadSample`` naming ``where`` (the shard) and the reason."""
    view = memoryview(data)
    found: dict[str, memoryview] = {}
    offsets: dict[str, int] = {}
    pos, long_name = 0, None
    bad = lambda why: BadSample.of(where, key, why)  # noqa: E731
    while pos < len(view):
        if len(view) - pos < BLOCK:
            raise bad(f"ends inside a tar header at byte {pos} of the sample ({len(view)} bytes)")
        header = bytes(view[pos:pos + BLOCK])
        if not header.strip(b"\0"):
            raise bad(f"a zero block at byte {pos} of its {len(view)} bytes (the manifest's range runs past "
                      "its last member, into the archive's end?)")
        try:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "strict")
        except (tarfile.HeaderError, UnicodeDecodeError) as e:
            raise bad(f"no valid tar header at byte {pos} of the sample ({e})") from None
        start, size = pos + BLOCK, info.size
        if size < 0 or start + size > len(view):
            raise bad(f"member {shown(long_name or info.name)} claims {size:,} bytes, the sample has "
                      f"{max(0, len(view) - start):,} left after its header")
        pos = start + size + (-size) % BLOCK
        if info.type == tarfile.GNUTYPE_LONGNAME:
            if long_name is not None or size > 4096:
                raise bad(f"a malformed long name at byte {start - BLOCK} of the sample")
            try:
                long_name = bytes(view[start:start + size]).rstrip(b"\0").decode("utf-8")
            except UnicodeDecodeError:
                raise bad(f"a long name that is not UTF-8 at byte {start - BLOCK} of the sample") from None
            continue
        name, long_name = long_name or info.name, None
        if info.type not in _REGULAR:
            kind = _KINDS.get(info.type, f"member of type {info.type!r}")
            raise bad(f"member {shown(name)} is a {kind}; a sample holds regular files only")
        suffix = name[len(key) + 1:] if name.startswith(key + ".") else None
        if suffix is None:
            raise bad(f"member {shown(name)} does not belong to it (a sample's members are {key}.SUFFIX)")
        if _suffix_kind(suffix, motion) is None:
            raise bad(f"member {shown(name)}: {shown(suffix)} is not a member the format has "
                      f"({allowed(motion)})")
        if suffix in found:
            raise bad(f"member {shown(name)} appears twice")
        found[suffix], offsets[suffix] = view[start:start + size], start
    return _assemble(found, offsets, key, label, frames, motion, where)


def _suffix_kind(suffix: str, motion: str) -> str | None:
    """Which field of ``Sample`` a member's suffix fills ("frame", "field", "label", "meta"), None
    for a suffix the format does not have (a field of a kind the set does not store included)."""
    if FRAME.fullmatch(suffix):
        return "frame"
    m = FIELD.fullmatch(suffix)
    if m:
        return "field" if m.group(2) == motion else None
    return {LABEL: "label", META: "meta"}.get(suffix)


def allowed(motion: str) -> str:
    """The schema in a few words, for a message."""
    fields = f", NN.{motion}.png" if motion != "none" else ""
    return f"NN.jpg{fields}, {LABEL}, {META}"


def _assemble(found: dict, offsets: dict, key: str, label: int, frames: int | None, motion: str,
              where: str) -> Sample:
    bad = lambda why: BadSample.of(where, key, why)  # noqa: E731
    numbers = sorted(int(FRAME.fullmatch(s).group(1)) for s in found if FRAME.fullmatch(s))
    count = frames if frames is not None else len(numbers)
    if count < 1:
        raise bad("no frames (members NN.jpg)")
    expected = list(range(count))
    if numbers != expected:
        missing = [f"{t:02d}.jpg" for t in expected if t not in numbers]
        extra = [f"{t:02d}.jpg" for t in numbers if t >= count]
        raise bad(f"{len(numbers)} frames where the set has {count}"
                  + (f": {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} missing"
                     if missing else "")
                  + (f": {', '.join(extra[:4])} beyond them" if extra and not missing else ""))
    frame_names = [f"{t:02d}.jpg" for t in expected]
    fields = []
    if motion != "none":
        field_names = [motionfield.member(t, motion) for t in expected]
        lost = [n for n in field_names if n not in found]
        if lost:
            raise bad(f"motion field {key}.{lost[0]} missing ({len(lost)} of {count})")
        fields = [found[n] for n in field_names]
    if label >= 0:
        if LABEL not in found:
            raise bad(f"member {key}.{LABEL} missing (the manifest gives label {label})")
        if bytes(found[LABEL]).strip() != str(label).encode():
            raise bad(f"member {key}.{LABEL} says {shown(bytes(found[LABEL])[:20])}, the manifest {label}")
    elif LABEL in found:
        raise bad(f"member {key}.{LABEL} present, but the manifest has the sample unlabelled (-1)")
    if META not in found:
        raise bad(f"member {key}.{META} missing")
    return Sample(key=key, frames=[found[n] for n in frame_names], fields=fields, label=label,
                  meta_bytes=bytes(found[META]), spans=[(offsets[n], len(found[n])) for n in frame_names],
                  where=where)


def parse_meta(data: bytes, where: str, key: str) -> dict:
    """A sample's ``json`` member as a dict: a ``BadSample`` when it is not UTF-8 JSON, not an
    object or larger than ``MAX_META_BYTES`` (nesting too deep for the parser included)."""
    bad = lambda why: BadSample.of(where, key, f"member {key}.{META} {why}")  # noqa: E731
    if len(data) > MAX_META_BYTES:
        raise bad(f"is {len(data):,} bytes (at most {MAX_META_BYTES:,})")
    try:
        meta = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise bad(f"is not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise bad(f"is a JSON {type(meta).__name__}, not an object")
    return meta
