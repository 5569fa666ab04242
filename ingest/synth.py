"""Generate a synthetic Kinetics-style video dataset whose classes differ only in motion.

Writes ``OUT/{train,val}/<label>/<id>.mp4``. Every video shows a textured disc on a textured
background; the class decides how the disc moves (translates left/right/up/down with wrap-around,
or spins clockwise/counter-clockwise in place). Position, orientation and textures of any single
frame are drawn from the same distribution for every class, so only motion over time tells the
classes apart. Output is byte-identical for the same arguments; videos already present are skipped.

With ``colours`` (``--colours N``) the classes combine appearance and motion, a task for two
streams: ``<colour>_<motion>`` for each of the first N disc colours and each motion, the disc's
texture centred on that colour instead of a random one. A single frame then tells the colour but
not the motion, and a motion field the motion but not the colour. Everything else about a video
(its textures' patterns, path, speed) is drawn as without colours, so the same video seeds give the
same videos with only the disc recoloured.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass

import ffmpeg
import numpy as np

from shards.base.commands import int_in_range
from shards.base.progress import Progress
from shards.base.words import plural

CLASSES = ("move_left", "move_right", "move_up", "move_down", "rotate_cw", "rotate_ccw")
SPLITS = ("train", "val")

# (dx, dy, spin) per class, y pointing down; a positive spin turns the disc clockwise on screen.
_MOTION = {
    "move_left": (-1, 0, 0), "move_right": (1, 0, 0), "move_up": (0, -1, 0), "move_down": (0, 1, 0),
    "rotate_cw": (0, 0, 1), "rotate_ccw": (0, 0, -1),
}

# Disc colours of --colours (mean RGB of the disc's texture), far apart from each other and from the
# backgrounds' grey-ish means (80-176 per channel).
COLOURS = {"red": (200.0, 45.0, 45.0), "green": (45.0, 185.0, 45.0), "blue": (45.0, 70.0, 215.0)}

# Sizes and speeds relative to the frame's short side, speeds per second: at the default 160x120,
# 10 fps that is 3-6 px (translation) or 9-18 degrees (spin) per frame, visible after downscaling to
# 64 px and far below the disc radius, so motion never aliases.
RADIUS = 0.22
SPEED = (0.25, 0.5)
SPIN_DEG = (90.0, 180.0)
# Texture contrast (std of each RGB channel): a calm background makes the disc the salient thing.
BACKGROUND_CONTRAST = 25.0
DISC_CONTRAST = 60.0

PRESETS = {
    "tiny": dict(width=160, height=120, fps=10, seconds=2.0),
    "bench-small": dict(width=340, height=256, fps=30, seconds=10.0),
    "bench": dict(width=1280, height=720, fps=30, seconds=10.0),
}


@dataclass(frozen=True)
class VideoJob:
    """One video to write: where, its own seed, its motion (and disc colour), and its shape."""

    path: str
    seed: tuple[int, ...]
    motion: str
    width: int
    height: int
    fps: int
    frames: int
    speed_scale: float = 1.0
    colour: str | None = None  # a key of COLOURS; None: the disc's colour drawn at random


def _smooth_noise(rng: np.random.Generator, h: int, w: int, sigma: float) -> np.ndarray:
    """Periodic Gaussian-filtered white noise, shape (h, w, 3), zero mean and unit std per channel."""
    white = rng.standard_normal((3, h, w))
    fy = np.fft.fftfreq(h)[:, None]
    fx = np.fft.rfftfreq(w)[None, :]
    gain = np.exp(-2 * (math.pi * sigma) ** 2 * (fx ** 2 + fy ** 2))
    field = np.fft.irfft2(np.fft.rfft2(white) * gain, s=(h, w))
    field -= field.mean(axis=(1, 2), keepdims=True)
    field /= field.std(axis=(1, 2), keepdims=True)
    return field.transpose(1, 2, 0)


def _texture(rng: np.random.Generator, h: int, w: int, sigma: float, contrast: float,
             colour: tuple[float, float, float] | None = None) -> np.ndarray:
    # drawn even when ``colour`` replaces it: the draws after stay the same
    mean = rng.uniform(80, 176, size=3)
    if colour is not None:
        mean = np.array(colour)
    return np.clip(mean + contrast * _smooth_noise(rng, h, w, sigma), 0, 255).astype(np.float32)


def _bilinear(tex: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Sample ``tex`` (h, w, 3) at float coordinates (column u, row v), all inside the texture."""
    u0 = u.astype(np.intp)
    v0 = v.astype(np.intp)
    fu = (u - u0)[..., None]
    fv = (v - v0)[..., None]
    flat = tex.reshape(-1, 3)
    i = v0 * tex.shape[1] + u0
    top_left, top_right = np.take(flat, i, axis=0), np.take(flat, i + 1, axis=0)
    i += tex.shape[1]
    bottom_left, bottom_right = np.take(flat, i, axis=0), np.take(flat, i + 1, axis=0)
    top = top_left + (top_right - top_left) * fu
    bottom = bottom_left + (bottom_right - bottom_left) * fu
    return top + (bottom - top) * fv


def _paint_disc(frame: np.ndarray, tex: np.ndarray, cx: float, cy: float, angle: float,
                radius: float) -> None:
    """Paint ``tex`` (float, square, centred on the disc) rotated by ``angle`` as an anti-aliased
    disc at (cx, cy) into the uint8 ``frame``, wrapping around the frame edges."""
    h, w = frame.shape[:2]
    half = (tex.shape[0] - 1) / 2
    reach = math.ceil(radius) + 1
    xs = math.floor(cx) + np.arange(-reach, reach + 1)
    ys = math.floor(cy) + np.arange(-reach, reach + 1)
    dx = (xs - cx).astype(np.float32)[None, :]
    dy = (ys - cy).astype(np.float32)[:, None]
    alpha = np.clip(radius + 0.5 - np.hypot(dx, dy), 0, 1)[..., None]
    # Inverse mapping: the frame pixel at offset (dx, dy) shows the texture point rotated by -angle.
    c, s = math.cos(angle), math.sin(angle)
    u = np.clip(c * dx + s * dy + half, 0, tex.shape[1] - 1.001)
    v = np.clip(-s * dx + c * dy + half, 0, tex.shape[0] - 1.001)
    region = np.ix_(ys % h, xs % w)
    frame[region] = np.rint(frame[region] * (1 - alpha) + _bilinear(tex, u, v) * alpha)


def render(job: VideoJob):
    """Yield the job's frames as (height, width, 3) uint8 arrays."""
    rng = np.random.default_rng(job.seed)
    w, h = job.width, job.height
    short = min(w, h)
    radius = RADIUS * short
    side = 2 * math.ceil(radius) + 5
    background = np.rint(_texture(rng, h, w, sigma=short / 24, contrast=BACKGROUND_CONTRAST)).astype(np.uint8)
    disc = _texture(rng, side, side, sigma=radius / 5, contrast=DISC_CONTRAST,
                    colour=COLOURS[job.colour] if job.colour else None)
    x0, y0 = rng.uniform(0, w), rng.uniform(0, h)
    angle0 = rng.uniform(0, 2 * math.pi)
    speed = rng.uniform(*SPEED) * short * job.speed_scale
    spin = math.radians(rng.uniform(*SPIN_DEG)) * job.speed_scale
    mx, my, turn = _MOTION[job.motion]
    for n in range(job.frames):
        t = n / job.fps
        frame = background.copy()
        _paint_disc(frame, disc, (x0 + mx * speed * t) % w, (y0 + my * speed * t) % h,
                    angle0 + turn * spin * t, radius)
        yield frame


def encode(job: VideoJob) -> None:
    """Render and encode one video: bit-exact libx264 into a temp file, then rename."""
    tmp = job.path + ".part"
    proc = (
        ffmpeg.input("pipe:", format="rawvideo", pix_fmt="rgb24", s=f"{job.width}x{job.height}",
                     framerate=job.fps)
        .output(tmp, format="mp4", vcodec="libx264", pix_fmt="yuv420p", threads=1,
                movflags="+faststart", fflags="+bitexact", map_metadata=-1, **{"flags:v": "+bitexact"})
        .global_args("-hide_banner", "-loglevel", "error")
        .overwrite_output()
        .run_async(pipe_stdin=True, pipe_stderr=True)
    )
    try:
        for frame in render(job):
            proc.stdin.write(frame.tobytes())
    except BrokenPipeError:
        pass  # ffmpeg quit early; its stderr says why
    _, err = proc.communicate()
    if proc.returncode != 0:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise RuntimeError(f"ffmpeg failed for {job.path}: {err.decode(errors='replace').strip()}")
    os.replace(tmp, job.path)


def class_kinds(classes: int, colours: int = 0) -> list[tuple[str, str | None, str]]:
    """The dataset's classes as (name, disc colour, motion): the first ``classes`` motions, each with
    every one of the first ``colours`` disc colours when there are any (``red_move_left``, ...)."""
    if not colours:
        return [(m, None, m) for m in CLASSES[:classes]]
    return [(f"{c}_{m}", c, m) for c in list(COLOURS)[:colours] for m in CLASSES[:classes]]


def plan(out: str, classes: int, train_per_class: int, val_per_class: int, width: int, height: int,
         fps: int, seconds: float, seed: int, speed_scale: float = 1.0, colours: int = 0) -> list[VideoJob]:
    """Every video of the dataset, in a fixed order."""
    frames = max(1, round(seconds * fps))
    jobs = []
    for split_index, (split, count) in enumerate(zip(SPLITS, (train_per_class, val_per_class))):
        for class_index, (label, colour, motion) in enumerate(class_kinds(classes, colours)):
            for i in range(count):
                path = os.path.join(out, split, label, f"{label}_{split}_{i:04d}.mp4")
                jobs.append(VideoJob(path, (seed, split_index, class_index, i), motion, width, height, fps,
                                     frames, speed_scale, colour))
    return jobs


def synthesize(out: str, classes: int = 4, train_per_class: int = 12, val_per_class: int = 4,
               width: int = 160, height: int = 120, fps: int = 10, seconds: float = 2.0, seed: int = 0,
               workers: int | None = None, speed_scale: float = 1.0, colours: int = 0) -> dict:
    """Write the dataset under ``out`` (skipping videos already there) and return a summary.
    ``speed_scale`` multiplies every video's translation and spin speeds (the rest is unchanged);
    ``colours``: classes of disc colour x motion (module docstring), 0 for motion alone."""
    if not 1 <= classes <= len(CLASSES):
        raise ValueError(f"classes must be in 1..{len(CLASSES)}, got {classes}")
    if not 0 <= colours <= len(COLOURS):
        raise ValueError(f"colours must be in 0..{len(COLOURS)}, got {colours}")
    if width % 2 or height % 2:
        raise ValueError(f"width and height must be even for yuv420p, got {width}x{height}")
    if not speed_scale > 0:
        raise ValueError(f"speed_scale must be positive, got {speed_scale}")
    start = time.perf_counter()
    jobs = plan(out, classes, train_per_class, val_per_class, width, height, fps, seconds, seed, speed_scale,
                colours)
    todo = [job for job in jobs if not os.path.exists(job.path)]
    for job in todo:
        os.makedirs(os.path.dirname(job.path), exist_ok=True)
    workers = min(workers or os.cpu_count() or 1, max(len(todo), 1))
    # spawn, not fork: callers may have threads running (Ray, pytest plugins)
    spawn = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(workers, mp_context=spawn) if workers > 1 else nullcontext()
    with pool, Progress(len(todo), desc="synth", unit="video") as bar:
        for _ in (pool.map if workers > 1 else map)(encode, todo):
            bar.update()
    names = [name for name, _, _ in class_kinds(classes, colours)]
    return {
        "out": out,
        "classes": names,
        "videos": {"train": len(names) * train_per_class, "val": len(names) * val_per_class},
        "written": len(todo),
        "skipped": len(jobs) - len(todo),
        "frames_per_video": jobs[0].frames if jobs else 0,
        "seconds": time.perf_counter() - start,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--classes", type=int, default=4,
                        help=f"number of classes, first N of {', '.join(CLASSES)}")
    parser.add_argument("--train-per-class", type=int, default=12, help="train videos per class")
    parser.add_argument("--val-per-class", type=int, default=4, help="val videos per class")
    presets = "; ".join(f"{k} {v['width']}x{v['height']} {v['fps']} fps {v['seconds']:g} s"
                        for k, v in PRESETS.items())
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help=f"size, rate and length: {presets}")
    parser.add_argument("--width", type=int, help="frame width (default: the --preset's)")
    parser.add_argument("--height", type=int, help="frame height (default: the --preset's)")
    parser.add_argument("--fps", type=int, help="frame rate (default: the --preset's)")
    parser.add_argument("--seconds", type=float, help="video length (default: the --preset's)")
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (each video derives its own)")
    parser.add_argument("--speed-scale", type=float, default=1.0,
                        help=f"multiplies the speeds ({SPEED[0]:g}-{SPEED[1]:g} short sides per second, "
                             f"{SPIN_DEG[0]:g}-{SPIN_DEG[1]:g} degrees per second); slower motion survives "
                             "clips whose frames lie far apart (multigrid's 2-frame clips)")
    parser.add_argument("--colours", type=int_in_range(0, len(COLOURS)), default=0,
                        help=f"0: classes differ only in motion; N (1-{len(COLOURS)}): classes are disc "
                             f"colour x motion (<colour>_<motion>, the first N of {', '.join(COLOURS)}), a "
                             "task that needs appearance and motion")
    parser.add_argument("--workers", type=int, help="encoder processes (default: one per CPU)")


def run(args: argparse.Namespace) -> int:
    shape = {k: getattr(args, k) if getattr(args, k) is not None else v
             for k, v in PRESETS[args.preset].items()}
    summary = synthesize(args.out, classes=args.classes, train_per_class=args.train_per_class,
                         val_per_class=args.val_per_class, seed=args.seed, workers=args.workers,
                         speed_scale=args.speed_scale, colours=args.colours, **shape)
    print(f"synth: {summary['written']} written, {summary['skipped']} already present; "
          f"{plural(len(summary['classes']), 'class', 'classes')}, train {summary['videos']['train']} / val "
          f"{summary['videos']['val']} videos of {shape['width']}x{shape['height']} at {shape['fps']} fps, "
          f"{summary['frames_per_video']} frames, in {summary['out']} ({summary['seconds']:.1f} s)")
    return 0
