"""Words for messages people read: counts (``plural(1, "shard")`` is "1 shard", ``plural(1536,
"rank")`` is "1,536 ranks", ``plural(2, "class", "classes")`` is "2 classes") and untrusted text
made safe to print (``shown``: a file name with escape codes or a newline in it is shown, never
obeyed by a terminal or taken for a second log line)."""
from __future__ import annotations


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    return f"{n:,} {noun if n == 1 else nouns or noun + 's'}"


def shown(text, limit: int = 200) -> str:
    """``text`` (str or bytes from outside: a name, a member, a field) quoted for one line: control
    and other unprintable characters escaped as Python writes them, invalid UTF-8 as ``\\xNN``, cut
    at ``limit`` characters."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text).decode("utf-8", "backslashreplace")
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    return repr(out if len(out) <= limit else out[:limit] + "...")
