"""Pack-time image handling: cheap validity checks and optional resize/re-encode.

The fast path never decodes: it checks the magic bytes and the end marker of the claimed
format (a JPEG without its end-of-image marker is truncated). Only files that fail it are
opened with PIL, which either identifies them (a PNG named .jpg is stored as png) or gives
the reason they are skipped.
"""

from __future__ import annotations

import io

from PIL import Image, ImageOps, UnidentifiedImageError

# ImageFolder's extensions (torchvision IMG_EXTENSIONS) -> WebDataset field name.
EXTENSIONS = {
    ".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp", ".bmp": "bmp",
    ".ppm": "ppm", ".pgm": "pgm", ".tif": "tiff", ".tiff": "tiff", ".gif": "gif",
}
_PIL_FORMATS = {
    "JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp", "BMP": "bmp", "PPM": "ppm",
    "TIFF": "tiff", "GIF": "gif",
}
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_PNG_END = b"IEND\xaeB`\x82"


class BadImage(Exception):
    """The bytes are not a usable image; the message is the reason."""


def field_for(path: str) -> str | None:
    """The field name for a file name, or None if it is not an image extension."""
    dot = path.rfind(".")
    return EXTENSIONS.get(path[dot:].lower()) if dot >= 0 else None


def _looks_complete(data: bytes, field: str) -> bool:
    if field == "jpg":
        # 0xFFD9 cannot occur inside entropy-coded data, so finding it near the end means
        # the scan was not cut short. (Trailing vendor data longer than this falls back to PIL.)
        return data.startswith(b"\xff\xd8\xff") and data.rfind(b"\xff\xd9", max(0, len(data) - 4096)) >= 0
    if field == "png":
        return data.startswith(_PNG_MAGIC) and data.rstrip(b"\x00").endswith(_PNG_END)
    if field == "webp":
        return data[:4] == b"RIFF" and data[8:12] == b"WEBP" and int.from_bytes(data[4:8], "little") + 8 <= len(data)
    return False  # rarer formats: let PIL check them


def _open(data: bytes) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except UnidentifiedImageError:
        raise BadImage("not an image file") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise _undecodable(e) from None
    return img


def _undecodable(e: Exception) -> BadImage:
    text = str(e)
    return BadImage("truncated image" if "truncated" in text else f"cannot decode image ({text})")


def check(data: bytes, field: str) -> str:
    """Validate image bytes claimed to be `field`; return the field they really are."""
    if not data:
        raise BadImage("empty file")
    if _looks_complete(data, field):
        return field
    img = _open(data)
    real = _PIL_FORMATS.get(img.format or "")
    if real is None:
        raise BadImage(f"unsupported image format {img.format}")
    return real


def reencode(data: bytes, resize: int | None, quality: int) -> bytes:
    """Decode, apply EXIF orientation, shrink the shorter side to `resize`, save as JPEG."""
    if not data:
        raise BadImage("empty file")
    try:
        img = Image.open(io.BytesIO(data))
        if resize and img.format == "JPEG":
            img.draft("RGB", (resize, resize))  # let libjpeg decode at 1/2, 1/4, 1/8 scale
    except UnidentifiedImageError:
        raise BadImage("not an image file") from None
    try:
        img = ImageOps.exif_transpose(img)
        img = img.convert("RGB")
    except (OSError, SyntaxError, ValueError) as e:
        raise _undecodable(e) from None
    if resize and min(img.size) > resize:
        w, h = img.size
        scale = resize / min(w, h)
        img = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    img.save(out, "JPEG", quality=quality)
    return out.getvalue()
