"""HTTP conditional and range requests for one file of known size and ETag (RFC 9110 §13-14),
as pure functions of header strings: no I/O, tested by table.

``evaluate`` decides the whole answer, in the RFC's order: If-Match (412), If-None-Match
(304), then If-Range and Range. What this server does with each kind of Range:

  * one satisfiable range (``a-b``, ``a-``, ``-n``) -> 206 with that range, ``b`` clamped to
    the last byte, a suffix longer than the file meaning the whole file;
  * one unsatisfiable range (first byte at or past the end, ``-0``, anything of an empty
    file) -> 416 with ``Content-Range: bytes */SIZE``;
  * several ranges -> 416 as well (RFC 9110 §15.5.17 lets a server reject a set of ranges;
    shard readers ask for one range at a time, and refusing multipart answers keeps a header
    like ``bytes=0-,0-,0-,...`` from multiplying the work). The parser stops at the first comma;
  * a malformed ``bytes=`` value (``bytes=x``, ``bytes=5-2``, ``bytes=-``) -> 400: the client is
    broken, and sending the whole file instead, as ignoring the header would, hides that at a
    cost of the whole file;
  * a byte number of more than 18 digits (no file is an exabyte; Python's ``int`` refuses strings of
    over 4,300 digits) is read as "past any end": a first byte -> 416, a last byte -> the file's
    end, a suffix -> the whole file; numbers are never converted before their length is checked;
  * another unit (``items=0-1``) is ignored as the RFC requires: 200 with the whole file;
  * Range on a method other than GET is ignored (RFC 9110 §14.2): HEAD answers as a plain GET would.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_SPEC = re.compile(r"(\d*)-(\d*)")
_DIGITS = 18  # beyond any file size: 10**18 bytes is an exabyte
_TAG = re.compile(r'\s*(W/)?("[^"]*")\s*(?:,|$)')


@dataclass(frozen=True)
class Answer:
    status: int  # 200, 206, 304, 400, 412 or 416
    start: int = 0
    end: int = 0  # exclusive
    reason: str = ""

    @property
    def length(self) -> int:
        return self.end - self.start


def parse_range(header: str, size: int) -> Answer:
    """The answer to a ``Range`` header on a GET of a ``size``-byte representation."""
    unit, sep, value = header.partition("=")
    if not sep or unit.strip().lower() != "bytes":
        return Answer(200, 0, size, "ignored: not a byte range")
    value = value.strip()
    if "," in value:
        return Answer(416, reason="multiple ranges are not served; ask for one range per request")
    m = _SPEC.fullmatch(value)
    if not m or (not m[1] and not m[2]):
        return Answer(400, reason=f"malformed byte range {value[:40]!r}")
    if not m[1]:  # suffix: the last n bytes
        n = _number(m[2], size)
        if n == 0 or size == 0:
            return Answer(416, reason="empty suffix range" if n == 0 else "the file is empty")
        return Answer(206, max(0, size - n), size)
    first = _number(m[1], size)
    last = _number(m[2], size) if m[2] else None
    if last is not None and last < first:
        return Answer(400, reason=f"malformed byte range {value[:40]!r}: last byte before first")
    if first >= size:
        return Answer(416, reason=f"the range starts at or past the end ({size} bytes)")
    return Answer(206, first, size if last is None else min(last + 1, size))


def _number(digits: str, size: int) -> int:
    """A byte number, any over 18 digits read as past the last byte (leading zeros do not count)."""
    digits = digits.lstrip("0") or "0"
    return max(size, 10 ** _DIGITS) if len(digits) > _DIGITS else int(digits)


def entity_tags(header: str) -> list[tuple[bool, str]] | None:
    """``If-Match``/``If-None-Match`` as (weak, "tag") pairs; ``*`` as [(False, "*")]; None if malformed."""
    if header.strip() == "*":
        return [(False, "*")]
    tags, pos = [], 0
    text = header.strip()
    while pos < len(text):
        m = _TAG.match(text, pos)
        if not m:
            return None
        tags.append((bool(m[1]), m[2]))
        pos = m.end()
    return tags


def evaluate(method: str, size: int, etag: str, headers) -> Answer:
    """The status and byte range for a GET or HEAD of a file with strong ``etag`` (quoted)."""
    full = Answer(200, 0, size)
    if "If-Match" in headers:  # strong comparison
        tags = entity_tags(headers["If-Match"])
        if not tags or not any(t == "*" or (not weak and t == etag) for weak, t in tags):
            return Answer(412, reason="If-Match does not match the current ETag")
    if "If-None-Match" in headers:  # weak comparison
        tags = entity_tags(headers["If-None-Match"])
        if tags and any(t in ("*", etag) for _, t in tags):
            return Answer(304)
    if method != "GET" or "Range" not in headers:
        return full
    if_range = headers.get("If-Range")
    if if_range is not None and if_range.strip() != etag:
        return full  # changed (or a date, which this server never validates): the whole file
    return parse_range(headers["Range"], size)
