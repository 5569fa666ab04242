"""Contact sheets of clips, as a PNG and/or a static HTML page: look before training.

One row per clip (its label and key, then its T frames in order), as a PNG (``--out``) and/or
a static HTML page (``--html DIR``). A set with motion fields (``ingest build --motion``) gets a
second row under each clip's frames: each frame's field in the colours of optical-flow figures
(``shards.format.motioncolour``: direction as hue, length as saturation, black where the motion is not
known), at one scale per clip, with the colour wheel and that scale beside it. Examples:

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
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ..base.errors import DataFault
from ..base.words import plural
from ..format import motioncolour
from ..format.digests import ALGORITHM, CorruptSample
from ..format.manifest import Manifest
from ..format.sample import BadSample
from ..io import storage
from ..read.clipindex import ClipIndex, read_clip

LABEL_WIDTH = 240  # pixels left of the frames for the label and key
GAP = 4
DAMAGED = (200, 0, 0)  # the colour a damaged clip's row is marked in
LEGEND = "direction: hue (right red, down yellow, left cyan, up blue); length: saturation; black: not known"


@dataclass
class Row:
    """One clip as the sheet shows it: its JPEG frames and coloured motion fields (none without
    motion), or why it is not shown (``damaged``)."""
    label: str
    key: str
    frames: list[bytes] = field(default_factory=list)
    pictures: list[Image.Image] = field(default_factory=list)  # the frames decoded
    motion: list[Image.Image] = field(default_factory=list)
    scale: float = 0.0  # pixels per frame at full colour
    damaged: str | None = None


def pick(index: ClipIndex, split: str, classes: list[str] | None, clips: int) -> list:
    """Up to ``clips`` clips of ``split`` (of ``classes``), spread evenly over the split's order."""
    part = index.split(split)
    labels = None if classes is None else [index.class_index(c) for c in classes]
    positions = part.matching(labels)
    if len(positions) == 0:
        return []
    chosen = np.unique(np.linspace(0, len(positions) - 1, min(clips, len(positions))).round().astype(int))
    return [part.clip(int(positions[k])) for k in chosen]


def read_row(manifest: Manifest, index: ClipIndex, clip) -> Row:
    """The clip's frames and, on a set with motion, its fields coloured; a clip whose bytes differ
    from the manifest's digest, or that the format refuses or whose frames do not decode, is a row
    saying why it is not shown."""
    row = Row(_label(index, clip), clip.key)
    try:
        sample = read_clip(manifest, clip)
        row.pictures = sample.pictures()
    except CorruptSample as e:
        row.damaged = f"damaged: {ALGORITHM} digest {e.found}, the manifest says {e.expected}"
        return row
    except BadSample as e:
        row.damaged = f"damaged: {e.why}"
        return row
    row.frames = [bytes(f) for f in sample.frames]
    if manifest.motion != "none":
        size = row.pictures[0].size
        row.motion, row.scale = motioncolour.render(sample.fields, size)
    return row


def _label(index: ClipIndex, clip) -> str:
    return index.classes[clip.label] if 0 <= clip.label < len(index.classes) else "(unlabeled)"


def _drawable(text: str, limit: int = 36) -> str:
    """What the default bitmap font can draw: Latin-1, cut to the label column."""
    text = text.encode("latin-1", "replace").decode("latin-1")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _fit(im: Image.Image, height: int) -> Image.Image:
    """``im`` at ``height`` pixels: enlarged pixel by pixel (what was stored, only bigger), reduced
    smoothly."""
    size = (max(1, round(im.width * height / im.height)), height)
    return im.resize(size, Image.Resampling.NEAREST if height >= im.height else Image.Resampling.BILINEAR)


def _scale_text(scale: float) -> str:
    return f"full colour: {scale:.2g} px/frame"


def sheet(rows: list[Row], height: int) -> Image.Image:
    """One row per clip: the text, then the frames scaled to ``height`` pixels, and under them,
    on a set with motion, the fields with the colour wheel and their scale; a damaged clip's row
    is a red frame around why instead."""
    scaled = [[_fit(im, height) for im in r.pictures] for r in rows]
    fields = [[_fit(im, height) for im in r.motion] for r in rows]
    width = LABEL_WIDTH + max([sum(im.width + GAP for im in ims) for ims in scaled] + [LABEL_WIDTH + GAP])
    # a clip's rows apart from the next's
    tall = [height + GAP + (height + 3 * GAP if f else 0) for f in fields]
    out = Image.new("RGB", (width, max(1, sum(tall) or height + GAP) + GAP), "white")
    draw, font = ImageDraw.Draw(out), ImageFont.load_default()
    wheel = _fit(motioncolour.legend(), height) if any(fields) else None
    y = GAP
    for row, ims, motion, h in zip(rows, scaled, fields, tall):
        colour = DAMAGED if row.damaged else "black"
        draw.text((GAP, y + 2), _drawable(row.label), fill=colour, font=font)
        draw.text((GAP, y + 18), _drawable(row.key), fill=DAMAGED if row.damaged else (90, 90, 90), font=font)
        if row.damaged:  # the text cut to the box (about 6 pixels a character)
            draw.rectangle((LABEL_WIDTH, y, width - GAP - 1, y + height - 1), fill=(255, 225, 225),
                           outline=DAMAGED, width=3)
            draw.text((LABEL_WIDTH + 8, y + 8), _drawable(row.damaged, (width - LABEL_WIDTH - 16) // 6),
                      fill=DAMAGED, font=font)
        for line, pictures in ((y, ims), (y + height + GAP, motion)):
            x = LABEL_WIDTH
            for im in pictures:
                out.paste(im, (x, line))
                if pictures is motion:  # a frame around it, in the gap: no motion is white, as the page
                    draw.rectangle((x - 1, line - 1, x + im.width, line + im.height), outline=(190, 190, 190))
                x += im.width + GAP
        if motion:  # the wheel and the scale in the label column, beside the fields
            out.paste(wheel, (GAP, y + height + GAP))
            draw.text((2 * GAP + wheel.width, y + height + GAP + 2), "motion", fill="black", font=font)
            draw.text((2 * GAP + wheel.width, y + height + GAP + 18), _drawable(_scale_text(row.scale)),
                      fill=(90, 90, 90), font=font)
        y += h
    return out


def write_html(directory: str, title: str, rows: list[Row], height: int) -> str:
    """``directory/index.html`` showing the rows, the frames beside it as ``frames/R_T.jpg``, the
    coloured fields as ``motion/R_T.png`` and their colour wheel as ``motion/legend.png``."""
    body, wheel = [], ""
    for r, row in enumerate(rows):
        head = f'<th>{html.escape(row.label)}<br><small>{html.escape(row.key)}</small></th>'
        if row.damaged:  # why it is not shown
            body.append(f'<tr class="damaged">{head}<td>{html.escape(row.damaged)}</td></tr>')
            continue
        cells, fields = [], []
        for t, data in enumerate(row.frames):
            storage.atomic_write(storage.join(directory, f"frames/{r:04d}_{t:02d}.jpg"), data)
            cells.append(f'<img src="frames/{r:04d}_{t:02d}.jpg" height="{height}" alt="frame {t}">')
        for t, picture in enumerate(row.motion):
            storage.atomic_write(storage.join(directory, f"motion/{r:04d}_{t:02d}.png"),
                                 motioncolour.png(picture))
            fields.append(f'<img src="motion/{r:04d}_{t:02d}.png" height="{height}" '
                          f'alt="motion of frame {t}">')
        motion = (f'<div class="motion">{"".join(fields)} '
                  f'<small>{html.escape(_scale_text(row.scale))}</small></div>' if fields else "")
        body.append(f'<tr>{head}<td><div>{"".join(cells)}</div>{motion}</td></tr>')
    if any(row.motion for row in rows):
        storage.atomic_write(storage.join(directory, "motion/legend.png"),
                             motioncolour.png(motioncolour.legend()))
        wheel = (f'<p class="legend"><img src="motion/legend.png" height="{height}" alt="colour wheel"> '
                 f'Under each clip, the motion of each frame: {html.escape(LEGEND)}.</p>\n')
    page = (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<title>{html.escape(title)}</title>'
            '<style>body{font-family:sans-serif}th{text-align:left;font-weight:normal;padding-right:1em}'
            'td img{margin-right:4px}td .motion{margin-top:4px}td .motion img{outline:1px solid #bbb}'
            '.legend img{vertical-align:middle}'
            'tr.damaged{color:#c80000}tr.damaged td{border:3px solid #c80000}</style></head>\n'
            f'<body><h1>{html.escape(title)}</h1>\n{wheel}<table>\n' + "\n".join(body)
            + "\n</table></body></html>\n")
    url = storage.join(directory, "index.html")
    storage.atomic_write(url, page.encode())
    return url


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shardset", help="shard-set directory URL or manifest.json URL "
                   "(a path, file://, http(s)://, s3://)")
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
    rows = [read_row(manifest, index, c) for c in clips]
    if args.out:
        buf = io.BytesIO()
        sheet(rows, args.height).save(buf, "PNG", optimize=True)
        storage.atomic_write(args.out, buf.getvalue())
        print(f"{args.out}: {plural(len(rows), 'clip')} of {args.split}")
    if args.html:
        title = f"{os.path.basename(manifest.base.rstrip('/')) or manifest.base}: {args.split}"
        print(f"{write_html(args.html, title, rows, args.height)}: {plural(len(rows), 'clip')} "
              f"of {args.split}")
    damaged = [f"{c.shard.name} sample {c.key}" for c, row in zip(clips, rows) if row.damaged]
    if damaged:
        raise DataFault(f"{len(damaged)} of the {len(rows)} clips shown are damaged and marked so "
                        f"({', '.join(damaged[:3])}{', ...' if len(damaged) > 3 else ''}); "
                        f"shards verify {args.shardset} checks every clip")
    return 0
