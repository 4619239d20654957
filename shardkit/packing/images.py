"""Pack-time image handling: cheap validity checks and optional resize/re-encode.

The fast path never decodes: it checks the magic bytes and the end marker of the claimed
format (a JPEG without its end-of-image marker is truncated). Only files that fail it are
opened with PIL, which either identifies them (a PNG named .jpg is stored as png) or gives
the reason they are skipped.
"""

from __future__ import annotations

import contextlib
import io
import struct
import threading
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from PIL import ExifTags, Image, ImageFile, ImageOps, UnidentifiedImageError

from ..decode import jpeg
from ..decode import is_image, to_rgb

# ImageFolder's extensions (torchvision IMG_EXTENSIONS) -> WebDataset field name.
EXTENSIONS = {
    ".jpg": "jpg",
    ".jpeg": "jpg",
    ".png": "png",
    ".webp": "webp",
    ".bmp": "bmp",
    ".ppm": "ppm",
    ".pgm": "pgm",
    ".tif": "tiff",
    ".tiff": "tiff",
    ".gif": "gif",
}
_PIL_FORMATS = {
    "JPEG": "jpg",
    "MPO": "jpg",
    "PNG": "png",
    "WEBP": "webp",
    "BMP": "bmp",
    "PPM": "ppm",
    "TIFF": "tiff",
    "GIF": "gif",
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
    """Whether the bytes are a whole image of `field` that PIL will open, judged from its
    headers and end marker, without decoding (False sends it to PIL to find out)."""
    if field == "jpg":
        scan = _jpeg_scan(data)
        # 0xFFD9 cannot occur inside entropy-coded data, so finding it near the end (after the
        # first scan: an EXIF thumbnail before it has its own) means the scan was not cut short.
        # (Trailing vendor data longer than 4 KB falls back to PIL.)
        end = data.rfind(b"\xff\xd9", max(scan[2], len(data) - 4096)) if scan is not None else -1
        if scan is None or not _fits(*scan[:2]) or end < 0:
            return False
        if (end - scan[2]) * 8 < scan[3]:
            raise BadImage(
                f"truncated image: {scan[0]}x{scan[1]} pixels in {end - scan[2]} bytes of scans, fewer "
                f"than the {_ceil(scan[3], 8)} that even a blank image of that size takes (its header "
                "claims more pixels than its data holds)"
            )
        return True
    if field == "png":
        return (
            data.startswith(_PNG_MAGIC)
            and data.rstrip(b"\x00").endswith(_PNG_END)
            and _fits(int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big"))
        )
    if field == "webp":
        if not (data[:4] == b"RIFF" and data[8:12] == b"WEBP" and int.from_bytes(data[4:8], "little") + 8 <= len(data)):
            return False
        try:
            return _fits(*Image.open(io.BytesIO(data)).size)  # the header only (its size is not at a fixed place)
        except Exception:  # noqa: BLE001 - PIL's verdict comes with its reason when it opens it for real
            return False
    return False  # rarer formats: let PIL check them


_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # start-of-frame markers (not DHT, JPG, DAC)
_HUFFMAN = frozenset({0xC0, 0xC1, 0xC2, 0xC3})  # baseline, extended, progressive, lossless: Huffman-coded


_SEGMENT = struct.Struct(">BBH")  # 0xFF, the marker, the segment's length
_FRAME = struct.Struct(">HHB")  # a start-of-frame's height, width and component count, 5 bytes into it


def _jpeg_scan(data: bytes) -> tuple[int, int, int, int] | None:
    """(width, height, offset of the first scan, the fewest bits its scans can take) of a
    JPEG, from its marker segments; None where they do not read as such."""
    if not data.startswith(b"\xff\xd8"):
        return None
    pos, frame, last = 2, None, len(data) - 9
    while pos <= last:
        ff, marker, length = _SEGMENT.unpack_from(data, pos)
        if ff != 0xFF:
            return None
        if marker == 0xFF:  # fill byte
            pos += 1
        elif marker == 0xDA:
            return (frame[0], frame[1], pos, frame[2]) if frame else None
        else:
            if marker in _SOF:
                height, width, _ = _FRAME.unpack_from(data, pos + 5)
                frame = (width, height, _least_bits(data, pos, width, height) if marker in _HUFFMAN else 0)
            pos += 2 + length
    return None


def _least_bits(data: bytes, pos: int, width: int, height: int) -> int:
    """The fewest bits a Huffman-coded frame's scans can take: every 8x8 block of every
    component has its DC coefficient coded, in one bit at the least. (A header claiming
    2000x2000 pixels over a 16x16 scan decodes to grey, which PIL accepts.)"""
    count = data[pos + 9] if pos + 9 < len(data) else 0
    factors = [(data[i] >> 4, data[i] & 15) for i in range(pos + 11, min(pos + 10 + 3 * count, len(data)), 3)]
    if not factors or any(h == 0 or v == 0 for h, v in factors):
        return 0  # not a frame to reason about: left to the decoders
    most_h, most_v = max(h for h, _ in factors), max(v for _, v in factors)
    return sum(_ceil(_ceil(width * h, most_h), 8) * _ceil(_ceil(height * v, most_v), 8) for h, v in factors)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _fits(width: int, height: int) -> bool:
    """Whether PIL opens an image of this size (it refuses decompression bombs: past twice
    `Image.MAX_IMAGE_PIXELS`), and it has pixels at all."""
    limit = Image.MAX_IMAGE_PIXELS
    return width > 0 and height > 0 and (limit is None or width * height <= 2 * limit)


_refusing = threading.Lock()
_refusers, _found = 0, False  # threads inside `_truncated_refused`, and the setting they found


@contextlib.contextmanager
def _truncated_refused() -> Iterator[None]:
    """PIL as it comes: a process that set `ImageFile.LOAD_TRUNCATED_IMAGES` (a common
    notebook line) would have truncated files decoded gray-padded, and packed. The setting
    is PIL's, for the whole process: a job's threads hold it off together, the first one in
    sets it aside and the last one out puts it back."""
    global _refusers, _found
    with _refusing:
        if _refusers == 0:
            _found, ImageFile.LOAD_TRUNCATED_IMAGES = ImageFile.LOAD_TRUNCATED_IMAGES, False
        _refusers += 1
    try:
        yield
    finally:
        with _refusing:
            _refusers -= 1
            if _refusers == 0:
                ImageFile.LOAD_TRUNCATED_IMAGES = _found


def _open(data: bytes) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(data))
        with _truncated_refused():
            img.load()
    except UnidentifiedImageError:
        raise BadImage("not an image file") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise _undecodable(e) from None
    return img


def _undecodable(e: Exception) -> BadImage:
    text = str(e)
    return BadImage("truncated image" if "truncated" in text.lower() else f"cannot decode image ({text})")


def check(data: bytes, field: str, decode: bool = False) -> str:
    """Validate image bytes claimed to be `field`; return the field they really are. The
    cheap checks (magic bytes, end marker) decide unless they fail or `decode` asks for the
    whole image to be decoded, as a reader's decoder would."""
    if not data:
        raise BadImage("empty file")
    if not decode and _looks_complete(data, field):
        return field
    if decode and _whole_jpeg(data):
        return "jpg"
    img = _open(data)
    real = _PIL_FORMATS.get(img.format or "")
    if real is None:
        raise BadImage(f"unsupported image format {img.format}")
    return real


def bad_images(fields: Mapping[str, Any]) -> Iterator[tuple[str, BadImage]]:
    """(field, why) for each image of a sample (a field the decoders take for one) that does
    not decode in full (see check_decodes)."""
    for field, value in fields.items():
        if isinstance(value, bytes) and is_image(field):
            try:
                check_decodes(value)
            except BadImage as e:
                yield field, e


def check_decodes(data: bytes) -> None:
    """Raise BadImage unless PIL decodes `data` in full, whatever its format: what the
    readers' decoders would refuse. (Damage that still decodes, to wrong pixels, passes:
    no decoder can tell it.)"""
    if not data:
        raise BadImage("empty file")
    if _whole_jpeg(data):
        return
    with warnings.catch_warnings():  # PIL's "Corrupt EXIF data" and the like: the image decodes
        warnings.simplefilter("ignore")
        _open(data)


_CUT_SHORT = "premature end of data segment"  # libjpeg-turbo's words for scans that end before the pixels do


def _whole_jpeg(data: bytes, scale: int = 1) -> bool:
    """Whether libjpeg-turbo decodes `data` as a JPEG in full with no warning (PIL, on the same
    library, then decodes it too, about 1.2x slower); False: PIL's to judge (a file cut off
    included: PIL refuses it). BadImage where the scans end, at a marker, before the pixels
    do: libjpeg-turbo fills the rest with grey and PIL takes that warning for a success."""
    said = jpeg.warning(data, scale)
    if said and _CUT_SHORT in said.lower():
        raise BadImage(f"truncated image: its data ends before its pixels do (libjpeg-turbo: {said})")
    return said == ""


def reencode(data: bytes, resize: int | None, quality: int) -> bytes:
    """Decode, apply EXIF orientation, shrink the shorter side to `resize`, save as JPEG."""
    if not data:
        raise BadImage("empty file")
    try:
        img = _decoded(Image.open(io.BytesIO(data)), data, resize)
    except UnidentifiedImageError:
        raise BadImage("not an image file") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise _undecodable(e) from None
    if resize and min(img.size) > resize:
        w, h = img.size
        scale = resize / min(w, h)
        img = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    img.save(out, "JPEG", quality=quality)
    return out.getvalue()


def _decoded(img: Image.Image, data: bytes, resize: int | None) -> Image.Image:
    """`img` (opened from `data`) decoded as RGB, its EXIF orientation applied, a JPEG scaled
    down by 1/2, 1/4 or 1/8 in the DCT domain as far as keeps both sides at least `resize`.
    A JPEG with no orientation to apply takes the fast path: PIL's very pixels, in about
    half the time (so the pack's bytes are the same either way)."""
    if img.format == "JPEG" and img.getexif().get(ExifTags.Base.Orientation, 1) == 1:
        hwc = jpeg.decode(data, (resize, resize) if resize else None)
        if hwc is not None:
            return Image.fromarray(hwc)
    if img.format == "JPEG":
        _whole_jpeg(data, 8)  # a scan that ends early, which PIL would decode to grey, is refused
    if resize and img.format == "JPEG":
        img.draft("RGB", (resize, resize))  # let libjpeg decode at 1/2, 1/4, 1/8 scale
    with _truncated_refused():
        return to_rgb(ImageOps.exif_transpose(img))
