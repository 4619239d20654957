"""`shardkit preview`: one shuffled batch drawn as a labelled PNG grid, to see what a model
will be fed (after the user's transform, if given). PIL only."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont, ImageOps

from ..bench.transforms import Transform
from ..decode import image_field, open_image, packed_from, to_rgb
from ..errors import FieldError, ShardkitError, describe
from ..storage import StorageOptions

TILE = 128  # pixels per image square
LABEL_H = 30  # the two label lines below each image: class name, key
CAPTION_H = 15  # and a third, the caption, where the samples have one (a `txt` field)
GAP = 2
BACKGROUND, TILE_BACKGROUND, TEXT, KEY_TEXT = (16, 16, 16), (48, 48, 48), (255, 255, 255), (170, 170, 170)


def grid_shape(n: int) -> tuple[int, int]:
    """(columns, rows) of the grid for n tiles: as square as possible."""
    cols = max(1, math.ceil(math.sqrt(n)))
    return cols, max(1, math.ceil(n / cols))


def _label_h(captions: bool) -> int:
    return LABEL_H + CAPTION_H * captions


def grid_size(n: int, tile: int = TILE, captions: bool = False) -> tuple[int, int]:
    """(width, height) in pixels of the PNG holding n tiles (with a caption line each)."""
    cols, rows = grid_shape(n)
    return cols * tile + (cols + 1) * GAP, rows * (tile + _label_h(captions)) + (rows + 1) * GAP


def tile_box(i: int, n: int, tile: int = TILE, captions: bool = False) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of tile i's image square."""
    cols, _ = grid_shape(n)
    left = GAP + (i % cols) * (tile + GAP)
    top = GAP + (i // cols) * (tile + _label_h(captions) + GAP)
    return left, top, left + tile, top + tile


def pick_image(result: Any) -> Any:
    """The image in a transform's result: the result itself, the first element of a tuple
    or list, or the first image field of a sample dict."""
    if isinstance(result, dict):
        key = image_field(result)
        return result[key] if key is not None else None
    if isinstance(result, (tuple, list)):
        return result[0] if result else None
    return result


def to_pil(image: Any) -> Image.Image:
    """An RGB PIL image from encoded bytes, a PIL image, a CHW torch tensor or an HWC (or
    CHW) array; floats in [0, 1] are scaled by 255, other floats (normalised) by min-max."""
    if isinstance(image, Image.Image):
        return to_rgb(image)
    if isinstance(image, (bytes, bytearray, memoryview)):
        try:
            return to_rgb(open_image(bytes(image)))
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:  # PIL's, for bad bytes
            raise FieldError(f"image: {describe(e)}") from e
    chw = False
    if hasattr(image, "detach"):  # torch tensor: CHW by convention
        image = image.detach().cpu()
        image = (image.float() if image.is_floating_point() else image).numpy()  # bfloat16: numpy has none
        chw = image.ndim == 3
    if not isinstance(image, np.ndarray) or image.ndim not in (2, 3):
        what = type(image).__name__ + (f" of shape {tuple(image.shape)}" if hasattr(image, "shape") else "")
        raise ShardkitError(f"the transform returned {what}: not an image (CHW tensor, HWC array or PIL image)")
    if image.ndim == 3 and (chw or (image.shape[0] in (1, 3, 4) and image.shape[-1] not in (1, 3, 4))):
        image = image.transpose(1, 2, 0)
    if image.dtype != np.uint8:
        a = image.astype(np.float64)
        lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 1.0)
        if np.issubdtype(image.dtype, np.floating):
            a = a * 255 if lo >= 0 and hi <= 1 else (a - lo) * (255 / (hi - lo or 1))
        image = np.clip(np.rint(a), 0, 255).astype(np.uint8)
    if image.ndim == 3:
        image = image[:, :, 0] if image.shape[2] == 1 else image[:, :, :3]
    return Image.fromarray(np.ascontiguousarray(image)).convert("RGB")


def _font(size: int = 12) -> Any:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: the fixed bitmap font
        return ImageFont.load_default()


def _fit(text: str, font: Any, width: int) -> str:
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text + "...") > width:
        text = text[:-1]
    return text + "..."


def draw_grid(
    tiles: Sequence[tuple[Image.Image, str, str]], tile: int = TILE, captions: Sequence[str] | None = None
) -> Image.Image:
    """The grid of (image, class name, key) tiles, each image fitted into its square, with
    `captions` (one a tile) on a line of their own below."""
    canvas = Image.new("RGB", grid_size(len(tiles), tile, captions is not None), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    font = _font()
    for i, (image, name, key) in enumerate(tiles):
        left, top, right, bottom = tile_box(i, len(tiles), tile, captions is not None)
        draw.rectangle((left, top, right - 1, bottom - 1), fill=TILE_BACKGROUND)
        fitted = ImageOps.contain(image, (tile, tile), Image.Resampling.BICUBIC)
        canvas.paste(fitted, (left + (tile - fitted.width) // 2, top + (tile - fitted.height) // 2))
        lines = [(name, TEXT)] + ([(captions[i], TEXT)] if captions is not None else []) + [(key, KEY_TEXT)]
        for line, (text, color) in enumerate(lines):
            draw.text((left + 2, bottom + 1 + line * LABEL_H // 2), _fit(text, font, tile - 4), fill=color, font=font)
    return canvas


def render_preview(
    url: str | Sequence[str],
    *,
    n: int = 16,
    out: str = "batch.png",
    transform: str | Callable[[dict[str, Any]], Any] | None = None,
    decode: str = "tensor",
    seed: int = 0,
    tile: int = TILE,
    storage_options: StorageOptions | None = None,
    on_error: str = "raise",
) -> dict[str, Any]:
    """Decode the first `n` samples of the seed's shuffled order (epoch 0), apply `transform`
    (a callable or ``module:function``), and write them as a labelled PNG grid to `out`
    (captioned, where the samples have a `txt` field).
    With on_error="skip" bad samples are left out (and counted) instead of stopping it:
    those the reader finds, and those the transform or the drawing find (an image left
    undecoded by decode="raw")."""
    from ..reading.dataset import StreamingDataset
    from ..reading.pass_ import bad_sample

    if n < 1 or tile < 16:
        raise ValueError("n must be at least 1 and tile at least 16")
    fn = Transform(transform) if isinstance(transform, str) else transform
    ds = StreamingDataset(
        url, shuffle=True, seed=seed, decode=decode, storage_options=storage_options, on_error=on_error
    )
    classes = ds.classes
    tiles: list[tuple[Image.Image, str, str]] = []
    captions: list[str] = []
    shown: set[tuple[str, str]] = set()
    skipped = 0
    stream = iter(ds)
    try:
        for sample in stream:
            key, label = str(sample["__key__"]), sample.get("cls")
            if (sample["__url__"], key) in shown:  # a skipped sample's stand-in: shown once
                continue
            shown.add((sample["__url__"], key))
            try:
                image = _image(sample, fn)
            except Exception as e:  # noqa: BLE001 - bad data is skipped or named as the reader's is
                said = bad_sample(e, ds.on_error, sample["__url__"], f"sample {key}{packed_from(sample)}", True)
                logging.getLogger("shardkit").warning("skipped %s", said)
                skipped += 1
                continue
            name = (
                classes[label]
                if isinstance(label, int) and 0 <= label < len(classes)
                else ("" if label is None else str(label))
            )
            tiles.append((image, name, key))
            captions.append(" ".join(str(sample.get("txt", "")).split()))  # a caption on one line
            if len(tiles) == n:
                break
    finally:
        del stream  # closes the shard reader now, not at garbage collection
    if not tiles:
        raise ShardkitError(f"{url}: no samples")
    captioned = any(captions)
    grid = draw_grid(tiles, tile, captions if captioned else None)
    grid.save(out, format=Image.registered_extensions().get(os.path.splitext(out)[1].lower(), "PNG"))
    cols, rows = grid_shape(len(tiles))
    return {
        "path": out,
        "samples": len(tiles),
        "grid": [cols, rows],
        "size": list(grid.size),
        "tile": tile,
        "labels": [[name, key] for _, name, key in tiles],
        **({"captions": captions} if captioned else {}),
        "skipped": int(ds.stats()["skipped"]) + skipped,
    }


def _image(sample: dict[str, Any], fn: Callable[[dict[str, Any]], Any] | None) -> Image.Image:
    """The image a sample's tile shows: the transform's result (or the sample), drawn."""
    result = fn(sample) if fn is not None else sample
    image = pick_image(result)
    if image is None:
        raise ShardkitError(
            f"sample {sample['__key__']}: no image in {type(result).__name__} "
            "(a transform should return an image or a tuple starting with one)"
        )
    return to_pil(image)
