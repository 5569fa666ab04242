"""Decoding only the crop of a JPEG frame: ``csrc/cropjpeg.c`` (libjpeg-turbo) through ctypes.

The train transform draws its crop from the frame size in the header before anything is
decoded, so only that rectangle needs decoding. A frame with restart markers that tile its MCU
rows (what ingest writes, ``ingest.jpeg``) is first cut down to the restart intervals under the
rectangle (``cut``): the entropy data around it is never decoded. Then, or for frames without
such markers, libjpeg-turbo skips the rows above the rectangle (entropy decoding only), stops
after its last row, and transforms only the block columns around it. Pixels equal a full decode
followed by the same crop (``tests/test_crop_decode.py``), and DCT-domain scaling by 1/2, 1/4
or 1/8 applies as in ``transforms.decode``.

The library is built by ``scripts/build-native.sh`` (``scripts/setup.sh`` runs it) into
``trainer/libcropjpeg.so``; ``KF_CROPJPEG`` names another path. Without it, ``available()``
is False, one log line says so, and the transforms decode whole frames with PIL.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading

import numpy as np

log = logging.getLogger(__name__)

# the library stays at trainer/libcropjpeg.so (scripts/build-native.sh, .gitignore, the images),
# above this room
DEFAULT_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "libcropjpeg.so")
_lib: ctypes.CDLL | None = None
_tried: str | None = None


def load(path: str | None = None) -> ctypes.CDLL | None:
    """The library at ``path`` (default: ``$KF_CROPJPEG`` or ``trainer/libcropjpeg.so``), or
    None, logged once per path, when it cannot be loaded."""
    global _lib, _tried
    path = path or os.environ.get("KF_CROPJPEG") or DEFAULT_PATH
    if path == _tried:
        return _lib
    _tried, _lib = path, None
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        log.warning("crop decoding off, decoding whole frames with PIL: cannot load %s (%s); "
                    "build it with scripts/build-native.sh", path, e)
        return None
    p, i, ip = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)
    lib.kf_decode_crop.argtypes = [p, ctypes.c_ulong, i, i, i, i, i, p, ctypes.c_long, ctypes.c_char_p, i]
    lib.kf_decode_crop.restype = i
    lib.kf_scaled_size.argtypes = [p, ctypes.c_ulong, i, ip, ip, ctypes.c_char_p, i]
    lib.kf_scaled_size.restype = i
    lib.kf_cut.argtypes = [p, ctypes.c_ulong, i, i, i, i, i, p, ip, ip, ctypes.c_char_p, i]
    lib.kf_cut.restype = ctypes.c_long
    _lib = lib
    return lib


def available() -> bool:
    return load() is not None


def _bytes(jpeg) -> np.ndarray:
    """A view of ``jpeg`` (bytes or a memoryview of a sample: ``shards.format.sample``) that the
    library can be handed without a copy."""
    return np.frombuffer(jpeg, dtype=np.uint8)


def scaled_size(jpeg: bytes, denom: int) -> tuple[int, int]:
    """(width, height) of the frame decoded at 1/denom scale."""
    w, h, msg, data = ctypes.c_int(), ctypes.c_int(), ctypes.create_string_buffer(200), _bytes(jpeg)
    if load().kf_scaled_size(data.ctypes.data, data.size, denom, ctypes.byref(w), ctypes.byref(h), msg,
                             len(msg)):
        raise ValueError(f"JPEG header: {msg.value.decode(errors='replace')}")
    return w.value, h.value


def decode_crop(jpeg: bytes, box: tuple[int, int, int, int], denom: int = 1,
                out: np.ndarray | None = None, lib: ctypes.CDLL | None = None) -> np.ndarray:
    """RGB pixels (h, w, 3) of ``box`` (left, top, right, bottom; integers) of the frame
    decoded at 1/denom scale, into ``out`` if given (rows may be strided, pixels contiguous);
    ``lib``: what ``load()`` gave, for a caller decoding many frames (looked up per call otherwise)."""
    x0, y0, x1, y1 = box
    if out is None:
        out = np.empty((y1 - y0, x1 - x0, 3), dtype=np.uint8)
    if out.shape != (y1 - y0, x1 - x0, 3) or out.dtype != np.uint8 or out.strides[1:] != (3, 1):
        raise ValueError(f"output array {out.shape} {out.dtype} {out.strides} does not fit box {box}")
    data, msg = _bytes(jpeg), _message()
    if (lib or load()).kf_decode_crop(data.ctypes.data, data.size, denom, x0, y0, x1 - x0, y1 - y0,
                                      out.ctypes.data, out.strides[0], msg, MESSAGE_BYTES):
        raise ValueError(f"JPEG decode: {msg.value.decode(errors='replace')}")
    return out


MESSAGE_BYTES = 200
_messages = threading.local()


def _message() -> ctypes.Array:
    """This thread's buffer for the library's error message (written only when a call fails)."""
    msg = getattr(_messages, "buffer", None)
    if msg is None:
        msg = _messages.buffer = ctypes.create_string_buffer(MESSAGE_BYTES)
    return msg


def cut(jpeg: bytes, box: tuple[int, int, int, int], denom: int = 1) -> tuple[bytes, tuple[int, int]] | None:
    """The smaller JPEG that ``decode_crop`` decodes for ``box`` (left, top, right, bottom) of
    the frame at 1/denom: the restart intervals under it and its context, with the box's
    (left, top) in it at that scale; None when the JPEG is decoded whole instead (no restart
    markers, or none that tile its MCU rows, or a box that needs every interval)."""
    x0, y0, x1, y1 = box
    buf, cx, cy, msg = (ctypes.create_string_buffer(len(jpeg) + 1), ctypes.c_int(), ctypes.c_int(),
                        ctypes.create_string_buffer(200))
    data = _bytes(jpeg)
    n = load().kf_cut(data.ctypes.data, data.size, denom, x0, y0, x1 - x0, y1 - y0, buf, ctypes.byref(cx),
                      ctypes.byref(cy), msg, len(msg))
    if n < 0:
        raise ValueError(f"JPEG cut: {msg.value.decode(errors='replace')}")
    return (buf.raw[:n], (cx.value, cy.value)) if n else None
