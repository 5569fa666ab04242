"""A video's wanted frames, decoded: the decoders, one entry each in ``DECODERS``, and the parsers
and types under them.

  * ``pyav_decoder``: in-process PyAV, decoding only the packets the wanted frames need (the
    container's index from ``mp4header``, the frame types from ``bitstream``, the packet plan in
    ``packets``), and the codec's motion vectors;
  * ``ffmpeg_cli``: the ffmpeg command line, the reference (slower; no motion vectors);
  * ``video``: what every decoder returns (``Decoded``, ``VideoInfo``) and raises (``DecodeError``);
    ``deadline``: the time one video may take; ``motion``: motion fields from the codec's vectors
    or from optical flow.

``DECODERS`` is the one list of decoders: ``ingest build --decoder``'s choices, ``ClipConfig``'s
check, the service's build requests and the fallback rule all read it, so a new decoder is a module
here and one entry below.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import ffmpeg_cli, pyav_decoder
from .deadline import Deadline
from .video import Decoded, DecodeError


@dataclass(frozen=True)
class Decoder:
    """One decoder: ``decode(path, wanted, short_side, *, threads, deadline, motion_vectors)``."""
    decode: Callable[..., Decoded]
    motion_vectors: bool = False  # exports the codec's motion vectors (``--motion mv``)
    fallback: str | None = None  # the decoder that gets a video this one fails on for one of ...
    fallback_reasons: tuple[str, ...] = ()  # ... these (the starts of a ``DecodeError``'s reason)
    explain: Callable[[str, Deadline], str] | None = None  # the detail of a refusal that has none


DECODERS = {
    # in-process failures the command line may still get past (a format or codec PyAV's FFmpeg lacks);
    # another refusal gets the command line's words about the file as its detail
    "pyav": Decoder(pyav_decoder.decode, motion_vectors=True, fallback="ffmpeg",
                    fallback_reasons=("not a readable video", "no frame decodes",
                                      "truncated or corrupt: decoded"),
                    explain=ffmpeg_cli.demux_messages),
    "ffmpeg": Decoder(ffmpeg_cli.decode),
}


def decode(name: str, path: str, wanted: Callable[[int], list[int]], short_side: int, *, threads: int,
           deadline: Deadline, motion_vectors: bool = False) -> Decoded:
    """``wanted(frame count)``'s frames of ``path`` by the decoder ``name``, or by its fallback when
    it fails for one of its fallback reasons."""
    decoder = DECODERS[name]
    try:
        return decoder.decode(path, wanted, short_side, threads=threads, deadline=deadline,
                              motion_vectors=motion_vectors)
    except DecodeError as e:
        if decoder.fallback is None or not e.reason.startswith(decoder.fallback_reasons):
            if decoder.explain is not None:
                e.detail = e.detail or decoder.explain(path, deadline)
            raise
    return decode(decoder.fallback, path, wanted, short_side, threads=threads, deadline=deadline,
                  motion_vectors=motion_vectors)
