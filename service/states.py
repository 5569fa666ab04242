"""How a set's state is shown, in one place: its word, its tone (the colour it is drawn in) and
what it means, for ``shard-service list`` (coloured on a terminal) and the viewer's badges (the
pages read this table from ``GET /v1/viewer``; the tones' colours are ``viewer.css``'s
``.tone-*``). A sound set is the only green one.

Which state a set is in, and what the server does with it, is ``shards.catalog.condition``'s.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Shown:
    tone: str  # good, bad, busy, warn or gone: the badge's colour (viewer.css .tone-*, ANSI below)
    meaning: str  # what the state says about the set, a few words


STATES = {
    "ready": Shown("good", "sound as far as known: served"),
    "damaged": Shown("bad", "problems found by its last verification: not served as sound (409)"),
    "changed": Shown("bad", "its manifest is no longer the one registered: not served (409)"),
    "replaced": Shown("gone", "another build was forced into its location: its files are gone (410)"),
    "failed": Shown("bad", "its build failed"),
    "building": Shown("busy", "being built"),
    "abandoned": Shown("warn", "its builder is gone (gc collects it)"),
    "deleted": Shown("gone", "forgotten by the catalog"),
}
UNKNOWN = Shown("warn", "a state this version does not know")
# SGR: green, bold red, yellow, dim
ANSI = {"good": "32", "bad": "1;31", "busy": "33", "warn": "33", "gone": "2"}


def table() -> dict:
    """{state: {"tone", "meaning"}}: what the viewer's pages draw badges with."""
    return {name: asdict(shown) for name, shown in STATES.items()}


def painted(name: str, width: int, stream) -> str:
    """``name`` padded to ``width``, in its tone's colour when ``stream`` is a terminal (and
    ``$NO_COLOR`` is not set: https://no-color.org)."""
    text = f"{name:<{width}}"
    if not (hasattr(stream, "isatty") and stream.isatty()) or os.environ.get("NO_COLOR"):
        return text
    return f"\x1b[{ANSI[STATES.get(name, UNKNOWN).tone]}m{name}\x1b[0m{text[len(name):]}"
