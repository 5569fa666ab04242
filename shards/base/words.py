"""Words for messages people read: counts (``plural(1, "shard")`` is "1 shard", ``plural(1536,
"rank")`` is "1,536 ranks", ``plural(2, "class", "classes")`` is "2 classes") and untrusted text
made safe to print (``printable``, and ``shown`` for one quoted and cut: a file name or a label with
escape codes or a newline in it is shown, never obeyed by a terminal or taken for a second log
line)."""
from __future__ import annotations


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    return f"{n:,} {noun if n == 1 else nouns or noun + 's'}"


def printable(text) -> str:
    """``text`` (str or bytes from outside) safe to print on a terminal or into a log: every
    character that is not printable (escape codes, line breaks, tabs, bidirectional overrides,
    other control and format characters) written as its Python escape (``\\x1b``, ``\\n``,
    ``\\u202e``), invalid UTF-8 as ``\\xNN``, the rest as it is."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text).decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def shown(text, limit: int = 200) -> str:
    """``text`` (str or bytes from outside: a name, a member, a field) ``printable`` and quoted for
    one line, cut at ``limit`` characters."""
    out = printable(text)
    return repr(out if len(out) <= limit else out[:limit] + "...")
