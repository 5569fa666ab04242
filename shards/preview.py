"""Contact sheets of clips, as a PNG and/or a static HTML page: look before training.

One row per clip (its label and key, then its T frames in order), as a PNG (``--out``) and/or
a static HTML page (``--html DIR``).

    shards preview shards/k400 --split val --classes "riding a bike" juggling --clips 12 --out sheet.png
    shards preview http://127.0.0.1:8765/v1/datasets/k400 --html preview/

Clips are spread evenly over those of the split (of the given classes), so a sheet shows the
whole split, not its first shard. Each clip is one byte-range read of its shard, from any URL
the loader reads, checked against the manifest's digest as the trainer checks it; frames go into
the HTML page as the stored JPEG bytes, unchanged. A clip whose bytes differ from the manifest is
not drawn: its row says so in red (both digests), and the command ends with exit status 1 after
writing the sheet (as ``shards verify`` does on a problem).
"""
from __future__ import annotations

import argparse
import html
import io
import os

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from . import storage
from .clipindex import ClipIndex, frame_spans
from .digests import ALGORITHM, CorruptSample
from .errors import CommandError
from .manifest import Manifest
from .reading import iter_samples

LABEL_WIDTH = 240  # pixels left of the frames for the label and key
GAP = 4
DAMAGED = (200, 0, 0)  # the colour a damaged clip's row is marked in


def pick(index: ClipIndex, split: str, classes: list[str] | None, clips: int) -> list:
    """Up to ``clips`` clips of ``split`` (of ``classes``), spread evenly over the split's order."""
    part = index.split(split)
    labels = None if classes is None else [index.class_index(c) for c in classes]
    positions = part.matching(labels)
    if len(positions) == 0:
        return []
    chosen = np.unique(np.linspace(0, len(positions) - 1, min(clips, len(positions))).round().astype(int))
    return [part.clip(int(positions[k])) for k in chosen]


def read_frames(manifest: Manifest, clip) -> list[bytes] | str:
    """The clip's JPEG frames, or, for a clip whose bytes differ from the manifest's digest, why
    it is not shown."""
    ((_, sample),) = iter_samples(manifest.shard_url(clip.shard), clip.shard, clip.index, clip.index + 1, bad=True)
    if isinstance(sample, CorruptSample):
        return f"damaged: {ALGORITHM} digest {sample.found}, the manifest says {sample.expected}"
    return [sample[offset:offset + size] for offset, size in frame_spans(sample)]


def _label(index: ClipIndex, clip) -> str:
    return index.classes[clip.label] if 0 <= clip.label < len(index.classes) else "(unlabeled)"


def _drawable(text: str, limit: int = 36) -> str:
    """What the default bitmap font can draw: Latin-1, cut to the label column."""
    text = text.encode("latin-1", "replace").decode("latin-1")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _fit(im: Image.Image, height: int) -> Image.Image:
    """``im`` at ``height`` pixels: enlarged pixel by pixel (what was stored, only bigger), reduced smoothly."""
    size = (max(1, round(im.width * height / im.height)), height)
    return im.resize(size, Image.Resampling.NEAREST if height >= im.height else Image.Resampling.BILINEAR)


def sheet(rows: list[tuple[str, str, list[bytes] | str]], height: int) -> Image.Image:
    """One row per (label, key, frames): the text, then the frames scaled to ``height`` pixels; a
    damaged clip's row (frames: why it is not shown) is a red frame around that text instead."""
    scaled = [[_fit(Image.open(io.BytesIO(f)).convert("RGB"), height) for f in frames] if isinstance(frames, list)
              else [] for _, _, frames in rows]
    width = LABEL_WIDTH + max([sum(im.width + GAP for im in ims) for ims in scaled] + [LABEL_WIDTH + GAP])
    out = Image.new("RGB", (width, max(1, len(rows)) * (height + GAP) + GAP), "white")
    draw, font = ImageDraw.Draw(out), ImageFont.load_default()
    for r, ((label, key, frames), ims) in enumerate(zip(rows, scaled)):
        y = GAP + r * (height + GAP)
        damaged = isinstance(frames, str)
        draw.text((GAP, y + 2), _drawable(label), fill=DAMAGED if damaged else "black", font=font)
        draw.text((GAP, y + 18), _drawable(key), fill=DAMAGED if damaged else (90, 90, 90), font=font)
        if damaged:  # the text cut to the box (about 6 pixels a character)
            draw.rectangle((LABEL_WIDTH, y, width - GAP - 1, y + height - 1), fill=(255, 225, 225), outline=DAMAGED,
                           width=3)
            draw.text((LABEL_WIDTH + 8, y + 8), _drawable(frames, (width - LABEL_WIDTH - 16) // 6), fill=DAMAGED,
                      font=font)
        x = LABEL_WIDTH
        for im in ims:
            out.paste(im, (x, y))
            x += im.width + GAP
    return out


def write_html(directory: str, title: str, rows: list[tuple[str, str, list[bytes]]], height: int) -> str:
    """``directory/index.html`` showing the rows, the frames beside it as ``frames/R_T.jpg``."""
    body = []
    for r, (label, key, frames) in enumerate(rows):
        if isinstance(frames, str):  # damaged: why it is not shown
            body.append(f'<tr class="damaged"><th>{html.escape(label)}<br><small>{html.escape(key)}</small></th>'
                        f'<td>{html.escape(frames)}</td></tr>')
            continue
        cells = []
        for t, data in enumerate(frames):
            storage.atomic_write(storage.join(directory, f"frames/{r:04d}_{t:02d}.jpg"), data)
            cells.append(f'<img src="frames/{r:04d}_{t:02d}.jpg" height="{height}" alt="frame {t}">')
        body.append(f'<tr><th>{html.escape(label)}<br><small>{html.escape(key)}</small></th>'
                    f'<td>{"".join(cells)}</td></tr>')
    page = (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            '<style>body{font-family:sans-serif}th{text-align:left;font-weight:normal;padding-right:1em}'
            'td img{margin-right:4px}tr.damaged{color:#c80000}tr.damaged td{border:3px solid #c80000}</style></head>\n'
            f'<body><h1>{html.escape(title)}</h1><table>\n' + "\n".join(body) + "\n</table></body></html>\n")
    url = storage.join(directory, "index.html")
    storage.atomic_write(url, page.encode())
    return url


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shardset", help="shard-set directory URL or manifest.json URL (a path, file://, http(s)://, s3://)")
    p.add_argument("--split", default="train", help="the split to show")
    p.add_argument("--classes", nargs="+", metavar="CLASS", help="only clips of these classes (names)")
    p.add_argument("--clips", type=int, default=8, help="rows: clips spread evenly over the split")
    p.add_argument("--height", type=int, default=96, help="frame height in the PNG, pixels")
    p.add_argument("--out", help="write the contact sheet here (PNG)")
    p.add_argument("--html", metavar="DIR", help="write the same as a static page DIR/index.html")


def run(args: argparse.Namespace) -> int:
    if not args.out and not args.html:
        raise SystemExit("shards preview: give --out sheet.png, --html DIR or both")
    if args.clips < 1 or args.height < 8:
        raise SystemExit("shards preview: --clips must be at least 1 and --height at least 8")
    try:
        manifest = Manifest.load(args.shardset)
        index = ClipIndex(manifest)
        clips = pick(index, args.split, args.classes, args.clips)
    except (FileNotFoundError, KeyError, ValueError) as e:
        raise SystemExit(f"shards preview: {e.args[0] if isinstance(e, KeyError) else e}") from None
    if not clips:
        raise SystemExit(f"shards preview: split {args.split} has no clips"
                         + (f" of {', '.join(args.classes)}" if args.classes else ""))
    rows = [(_label(index, c), c.key, read_frames(manifest, c)) for c in clips]
    if args.out:
        buf = io.BytesIO()
        sheet(rows, args.height).save(buf, "PNG", optimize=True)
        storage.atomic_write(args.out, buf.getvalue())
        print(f"{args.out}: {len(rows)} clips of {args.split}")
    if args.html:
        title = f"{os.path.basename(manifest.base.rstrip('/')) or manifest.base}: {args.split}"
        print(f"{write_html(args.html, title, rows, args.height)}: {len(rows)} clips of {args.split}")
    damaged = [f"{c.shard.name} sample {c.key}" for c, (_, _, frames) in zip(clips, rows) if isinstance(frames, str)]
    if damaged:
        raise CommandError(f"{len(damaged)} of the {len(rows)} clips shown differ from the manifest's digests and are "
                           f"marked damaged ({', '.join(damaged[:3])}{', ...' if len(damaged) > 3 else ''}); "
                           f"shards verify {args.shardset} checks every clip")
    return 0
