"""The script a user would write instead of ``ingest build``: the peer that ``bench/ingest.py`` times.

A process pool; per video the decoder's frame count, the same TSN picks as ``ingest build``
(``ingest.sampling``, one training clip of 8 frames), the picked frames from torchcodec
(``VideoDecoder(...).get_frames_at``, exact or approximate seek mode, or with the resize done in
the decoder) or decord (``VideoReader(...).get_batch``), an OpenCV area resize to short side 256,
simplejpeg at quality 90 (4:2:0), and one webdataset ``TarWriter`` in the parent. One decoder
thread per worker, as ``ingest build``'s default. The decoders are optional bench dependencies
(``pip install -e '.[bench]'``: torchcodec 0.13.0, whose CPU build loads beside the CPU torch,
and decord 0.6.0).

    python bench/peer_ingest.py --decoder decord --workers 2 SRC OUT.tar
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import cv2
import numpy as np
import simplejpeg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ingest.sampling import clip_indices  # noqa: E402  the same picks as ingest build's

DECODERS = ("torchcodec_exact", "torchcodec_approximate", "torchcodec_resize", "decord")
FRAMES, SHORT_SIDE, QUALITY = 8, 256, 90


def out_size(width: int, height: int) -> tuple[int, int]:
    if width <= height:
        return SHORT_SIDE, max(1, round(height * SHORT_SIDE / width))
    return max(1, round(width * SHORT_SIDE / height)), SHORT_SIDE


def _torchcodec(path: str, mode: str, resize: bool) -> tuple[int, np.ndarray]:
    from torchcodec.decoders import VideoDecoder

    transforms = None
    if resize:  # the output size needs the stream's, from the header
        meta = VideoDecoder(path, seek_mode="approximate").metadata
        w, h = out_size(meta.width, meta.height)
        from torchcodec.transforms import Resize
        transforms = [Resize((h, w))]
    decoder = VideoDecoder(path, seek_mode=mode, num_ffmpeg_threads=1, dimension_order="NHWC",
                           transforms=transforms)
    n = decoder.metadata.num_frames
    return n, decoder.get_frames_at(picks(path, n)).data.numpy()


def _decord(path: str) -> tuple[int, np.ndarray]:
    import decord

    reader = decord.VideoReader(path, num_threads=1)
    n = len(reader)
    return n, reader.get_batch(picks(path, n)).asnumpy()


def picks(path: str, num_frames: int) -> list[int]:
    return clip_indices(num_frames, FRAMES, train=True, seed=0, video_id=Path(path).stem, clip=0, num_clips=1)


def clip(path: str, decoder: str) -> dict:
    """One video's sample: 8 JPEG frames, its class folder as label and a little metadata."""
    if decoder == "decord":
        n, frames = _decord(path)
    else:
        n, frames = _torchcodec(path, decoder.split("_")[1].replace("resize", "exact"),
                                decoder.endswith("resize"))
    size = out_size(frames.shape[2], frames.shape[1])
    sample = {"__key__": Path(path).stem, "json": json.dumps({"source": path, "num_frames": n}).encode()}
    for t, frame in enumerate(frames):
        if frame.shape[1::-1] != size:
            frame = cv2.resize(frame, size, interpolation=cv2.INTER_AREA)
        sample[f"{t:02d}.jpg"] = simplejpeg.encode_jpeg(np.ascontiguousarray(frame), quality=QUALITY,
                                                       colorspace="RGB", colorsubsampling="420")
    return sample


def videos_of(src: str) -> list[str]:
    return sorted(str(p) for p in Path(src).rglob("*") if p.suffix in (".mp4", ".avi", ".mkv", ".webm"))


def _one_thread() -> None:
    cv2.setNumThreads(1)


def pool(workers: int, decoder: str) -> ProcessPoolExecutor:
    """Workers forked from this process, after it imported the decoder (as a script's imports at its top)."""
    if decoder == "decord":
        import decord  # noqa: F401
    else:
        import torchcodec.decoders  # noqa: F401
        import torchcodec.transforms  # noqa: F401
    return ProcessPoolExecutor(workers, initializer=_one_thread)


def run(videos: list[str], out: str, decoder: str, executor: ProcessPoolExecutor) -> int:
    """Decode, resize, encode on ``executor``; write the samples in order to one tar at ``out``."""
    import webdataset as wds

    labels = {c: i for i, c in enumerate(sorted({Path(v).parent.name for v in videos}))}
    with wds.TarWriter(out) as tar:
        for path, sample in zip(videos, executor.map(clip, videos, [decoder] * len(videos), chunksize=1)):
            tar.write({**sample, "cls": str(labels[Path(path).parent.name]).encode()})
    return len(videos)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src")
    p.add_argument("out", help="the tar to write")
    p.add_argument("--decoder", choices=DECODERS, default="decord")
    p.add_argument("--workers", type=int, default=os.cpu_count())
    args = p.parse_args()
    with pool(args.workers, args.decoder) as executor:
        run(videos_of(args.src), args.out, args.decoder, executor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
