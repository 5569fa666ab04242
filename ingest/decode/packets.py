"""Which packets a decoder must see for some frames to come out exactly as in a full decode.

Pure functions over a packet index (one entry per packet of the video stream, in decode
order). The plan:

1. The frames of a video are what it displays: the packets the container does not mark
   discarded (an edit list's pre-roll is decoded, never shown), in presentation-time order.
   Frame ``i`` is the packet with the ``i``-th smallest pts (``displayed``). Frame counts come
   from here, not from the container's header.
2. A packet is needed if it is picked, or if it is a reference that comes before a picked
   packet in decode order and after the last barrier before it (``plan``): a decoder fed only
   those packets produces the picked frames bit for bit as a full decode does, since no
   needed frame refers to a packet left out (``bitstream`` says which packets are references
   and barriers). Nothing after the last pick is needed.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Packet:
    pts: int | None
    discard: bool = False  # edit-list pre-roll: decoded for its references, not displayed
    reference: bool = True
    barrier: bool = False


def displayed(packets: list[Packet]) -> list[int] | None:
    """Decode-order index of each displayed frame, in display order; None when timestamps cannot
    order them (missing or repeated pts: then only decoding can tell)."""
    shown = [i for i, p in enumerate(packets) if not p.discard]
    pts = [packets[i].pts for i in shown]
    if None in pts or len(set(pts)) != len(pts):
        return None
    return sorted(shown, key=lambda i: packets[i].pts)


def plan(packets: list[Packet], picks: set[int]) -> list[int]:
    """Decode-order indices of the packets to decode, in order, so that every packet of
    ``picks`` (decode-order indices) decodes as in a full decode."""
    feed, start = [], 0
    bounds = [i for i, p in enumerate(packets) if p.barrier and i > 0] + [len(packets)]
    for end in bounds:  # runs [start, end) from one barrier to the next
        last = max((i for i in picks if start <= i < end), default=None)
        if last is not None:
            feed += [i for i in range(start, last + 1) if packets[i].reference or i in picks]
        start = end
    return feed
