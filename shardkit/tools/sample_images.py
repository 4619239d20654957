"""A small ImageFolder to try shardkit on, drawn with PIL: nothing to download, nothing extra
to install. Three classes (circle, square, triangle: a shape a small model can learn), one
image size, and JPEG, PNG and WebP mixed, so the Quickstart's first loader shows `"image"`
collating whatever the extension. The same arguments write the same bytes.

    python -m shardkit.tools.sample_images ./photos [--per-class 40] [--size 320x240]
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

CLASSES = ("circle", "square", "triangle")
FORMATS = ("jpg", "jpg", "png", "jpg", "webp")  # mostly JPEG, as photo folders are
_SAVE = {"jpg": ("JPEG", {"quality": 90}), "png": ("PNG", {}), "webp": ("WEBP", {"quality": 90})}


def paths(root: Path, per_class: int) -> list[tuple[Path, int, int]]:
    """(path, class number, image number) of every image, class after class."""
    return [
        (root / name / f"{name}_{i:04d}.{FORMATS[i % len(FORMATS)]}", label, i)
        for label, name in enumerate(CLASSES)
        for i in range(per_class)
    ]


def render(label: int, index: int, size: tuple[int, int]) -> Image.Image:
    """A shape of class `label` on a gradient, its place, size and colours drawn from (label, index)."""
    rng = np.random.default_rng([label, index])
    w, h = size
    top, bottom = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    rows = np.linspace(0.0, 1.0, h)[:, None, None]
    pixels = (top * (1 - rows) + bottom * rows).repeat(w, axis=1)
    pixels += rng.normal(0, 6, pixels.shape)  # a little grain, as a photo has
    img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    side = int(rng.integers(min(w, h) // 3, min(w, h) * 4 // 5))
    x, y = int(rng.integers(0, w - side)), int(rng.integers(0, h - side))
    fill = tuple(int(c) for c in rng.integers(0, 256, 3))
    draw = ImageDraw.Draw(img)
    if label == 0:
        draw.ellipse((x, y, x + side, y + side), fill=fill)
    elif label == 1:
        draw.rectangle((x, y, x + side, y + side), fill=fill)
    else:
        draw.polygon([(x, y + side), (x + side, y + side), (x + side // 2, y)], fill=fill)
    return img


def write(root: str | Path, per_class: int = 40, size: tuple[int, int] = (320, 240)) -> list[Path]:
    """Write the images under `root` (made if missing); return their paths. A folder that
    already holds other files is refused, so a pack of it never mixes in someone's data."""
    root = Path(root)
    if per_class < 1 or min(size) < 16:
        raise ValueError("need --per-class >= 1 and both sides >= 16 pixels")
    planned = paths(root, per_class)
    if root.exists():
        others = sorted(p for p in root.rglob("*") if p.is_file() and p not in {q for q, _, _ in planned})
        if others:
            raise FileExistsError(f"{root}: holds files this did not write ({others[0]}, ...): name a new folder")
    for path, label, i in planned:
        fmt, options = _SAVE[path.suffix[1:]]
        buf = io.BytesIO()
        render(label, i, size).save(buf, fmt, **options)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buf.getvalue())
    return [p for p, _, _ in planned]


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give WIDTHxHEIGHT, e.g. 320x240") from None
    return w, h


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m shardkit.tools.sample_images", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )
    ap.add_argument("root", help="the folder to write: ROOT/<class>/<image>")
    ap.add_argument("--per-class", type=int, default=40, help="images per class (default 40)")
    ap.add_argument("--size", type=_size, default=(320, 240), help="WIDTHxHEIGHT of every image (default 320x240)")
    args = ap.parse_args(argv)
    try:
        written = write(args.root, args.per_class, args.size)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    total = sum(p.stat().st_size for p in written)
    print(f"{len(written)} images in {len(CLASSES)} classes under {args.root} ({total / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
