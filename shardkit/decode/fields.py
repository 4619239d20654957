"""A sample's raw fields into Python values, WebDataset style (see the package's docstring):
the modes and backends, the sample dict and its decoded form (`Sample`), the decoder, and
opening an image (PIL's, or the fast path of `jpeg.py` for JPEG)."""

from __future__ import annotations

import functools
import io
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import orjson
from PIL import Image, UnidentifiedImageError

from . import jpeg
from ..errors import FieldError, describe

MODES = ("raw", "pil", "rgb8", "tensor")
IMAGE, EXT = "image", "__ext__"  # a decoded sample's image, whatever its extension, and the field it came from
BACKENDS = ("auto", "pil")  # auto: the fast path for JPEG, PIL for the rest
IMAGE_FIELDS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "pbm", "pnm", "tif", "tiff", "gif"})
_INT_FIELDS = ("cls", "cls2", "index", "inx", "id")  # webdataset's decoders (its docstring lists more)
_JSON_FIELDS = ("json", "jsn")
_TEXT_FIELDS = ("txt", "text", "transcript")
_LONG_DIGITS = re.compile(rb"\d{19}")  # orjson reads integers past 64 bits as floats: json it is


def _kind(field: str) -> str:
    """What a field holds, by WebDataset's rule: its last extension, in lower case
    (`seg.png` and `JPG` are images), before a `.gz` (which the readers inflate)."""
    return field.lower().removesuffix(".gz").rsplit(".", 1)[-1]


def sample_dict(key: str, url: str, fields: Mapping[str, bytes]) -> dict[str, Any]:
    """A sample in WebDataset's convention: `__key__`, `__url__` and one entry per member,
    named by its extension in lower case (a camera's `.JPG` is `jpg`, as webdataset reads it)."""
    sample: dict[str, Any] = {"__key__": key, "__url__": url}
    for ext, data in fields.items():
        sample[ext.lower()] = data
    if len(sample) != len(fields) + 2:
        raise FieldError(f"members {sorted(fields)} name the same field once in lower case")
    return sample


class Sample(dict[str, Any]):
    """A decoded sample: its image under "image", the field it came from under "__ext__".
    That field's own name still reads the image (`s["png"]`, `s.get("png")`), but is not a key
    of its own, so default_collate stacks the image once; a batch of one format reads the same."""

    def __missing__(self, key: str) -> Any:
        if self._names_image(key):
            return dict.__getitem__(self, IMAGE)
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self or self._names_image(key) else default

    def _names_image(self, key: str) -> bool:
        ext = dict.get(self, EXT)  # a str; in a batch (default_collate's), a list of them
        names = [ext] if isinstance(ext, str) else ext if isinstance(ext, list) else []
        return bool(names) and IMAGE in self and all(name == key for name in names)


def with_image(sample: dict[str, Any]) -> dict[str, Any]:
    """`sample` as a `Sample`: its first image field renamed "image" (the same object, not a
    copy) and its name kept in "__ext__"; unchanged if it has no image or has an "image" field."""
    field = image_field(sample)
    if field is None or field == IMAGE or IMAGE in sample:
        return sample
    out = Sample((IMAGE if key == field else key, value) for key, value in sample.items())
    out[EXT] = field
    return out


def packed_from(sample: Mapping[str, Any]) -> str:
    """' (packed from PATH)': the file a sample was made from, for messages about it, as its
    json field records it (`shardkit pack` writes {"class": ..., "path": PATH relative to
    SRC}); '' where the sample does not say. Its json may be decoded already, or not."""
    meta = sample.get("json")
    if isinstance(meta, (bytes, bytearray, memoryview)):
        try:
            meta = _json(bytes(meta))
        except ValueError:  # not json: the sample says nothing of its source
            return ""
    path = meta.get("path") if isinstance(meta, dict) else None
    return f" (packed from {path})" if isinstance(path, str) else ""


def _json(value: bytes) -> Any:
    """orjson (~6x faster here on small metadata) wherever its answer is json's; json for
    long runs of digits and for what orjson refuses (NaN, Infinity, lone surrogates), with
    json's answer or json's error."""
    if _LONG_DIGITS.search(value) is None:
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            pass
    return json.loads(value)  # bytes: UTF-8, -16 or -32, a BOM allowed, as webdataset reads them


def _text(value: bytes) -> str:
    return value.decode("utf-8")


_GRAY_16 = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})


def to_rgb(img: Image.Image) -> Image.Image:
    """`img` decoded (a bad file raises here), as 8-bit RGB (PIL's `convert`). 16-bit
    grayscale (depth maps, scans, PNG or TIFF) keeps its contrast, by its high byte, where
    `convert` clips every value over 255 to white. (32-bit "I" says nothing of its range:
    label maps hold small numbers.)"""
    img.load()
    if img.mode in _GRAY_16:
        img = Image.fromarray((np.asarray(img) >> 8).astype(np.uint8))
    return img if img.mode == "RGB" else img.convert("RGB")


def open_image(data: bytes | bytearray | memoryview) -> Image.Image:
    """PIL's lazy open of an encoded image; bytes it cannot tell the format of raise
    UnidentifiedImageError saying how they start (PIL's own names the buffer object)."""
    try:
        return Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise UnidentifiedImageError(
            f"cannot identify an image format in {len(data)} bytes starting {bytes(data[:8])!r}"
        ) from None


def _pil(data: bytes) -> Image.Image:
    img = open_image(data)
    img.draft("RGB", img.size)  # lets libjpeg decode straight to RGB
    return to_rgb(img)


def _rgb8(data: bytes) -> np.ndarray:
    return np.array(_pil(data))  # writable, unlike np.asarray's view of the PIL buffer


def to_chw(img: Image.Image | np.ndarray) -> Any:
    """`img`'s HWC pixels as a CHW uint8 torch tensor of their own."""
    import torch

    chw = np.asarray(img).transpose(2, 0, 1)
    # a copy, writable (np.asarray of a PIL image is a read-only view); ascontiguousarray
    # would hand back the read-only view itself where the transpose is already contiguous (1x1)
    return torch.from_numpy(np.array(chw, order="C"))


def _tensor(data: bytes) -> Any:
    return to_chw(_pil(data))


def _fast_rgb8(data: bytes) -> np.ndarray:
    hwc = jpeg.decode(data)
    return _rgb8(data) if hwc is None else hwc


def _fast_tensor(data: bytes) -> Any:
    hwc = jpeg.decode(data)
    return _tensor(data) if hwc is None else to_chw(hwc)


_IMAGE: dict[str, Callable[[bytes], Any]] = {"pil": _pil, "rgb8": _rgb8, "tensor": _tensor}
_FAST: dict[str, Callable[[bytes], Any]] = {"rgb8": _fast_rgb8, "tensor": _fast_tensor}


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")


@functools.cache
def warm_up() -> None:
    """Load PIL's format plugins and run libjpeg once in this process. Datasets call it when
    built, in the main process, so DataLoader workers forked later start decoding at full
    speed instead of each paying ~20 ms on its first image, which is on the path to the
    first batch."""
    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, "JPEG")
    np.asarray(_pil(buf.getvalue()).resize((8, 8), Image.Resampling.BILINEAR))
    jpeg.decode(buf.getvalue())  # imports simplejpeg before the fork


def decoder(mode: str, backend: str = "auto") -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A function decoding one sample's fields in place (images by the fast path for JPEG
    unless `backend="pil"`). Raises ValueError for unknown modes and backends."""
    if mode not in MODES:
        raise ValueError(f"decode must be one of {MODES}, not {mode!r}")
    check_backend(backend)
    warm_up()
    handlers: dict[str, Callable[[bytes], Any]] = {
        **dict.fromkeys(_INT_FIELDS, int),
        **dict.fromkeys(_JSON_FIELDS, _json),
        **dict.fromkeys(_TEXT_FIELDS, _text),
    }
    image = (_FAST.get(mode) if backend == "auto" else None) or _IMAGE.get(mode)
    if image is not None:
        handlers.update(dict.fromkeys(IMAGE_FIELDS, image))

    chosen: dict[str, Callable[[bytes], Any] | None] = {}  # field name -> handler, looked up once

    def decode(sample: dict[str, Any]) -> dict[str, Any]:
        for key, value in sample.items():
            if key.startswith("_"):  # __key__, __url__ (and a member with no extension: field "")
                continue
            try:
                handler = chosen[key]
            except KeyError:
                handler = chosen[key] = handlers.get(key) or handlers.get(_kind(key))
            if handler is not None:
                try:
                    sample[key] = handler(value)
                except MemoryError:  # the machine's, not the data's
                    raise
                except Exception as e:  # noqa: BLE001 - the field named here, the sample by the reader
                    raise FieldError(f"field {key!r}: {describe(e)}") from e
        return sample if image is None else with_image(sample)

    return decode


def is_image(field: str) -> bool:
    """Whether the decoders take `field` for an image (jpg, png, seg.PNG, pbm, ...), or it
    holds a decoded one ("image")."""
    return field == IMAGE or (not field.startswith("_") and _kind(field) in IMAGE_FIELDS)


def image_field(sample: dict[str, Any]) -> str | None:
    """The sample's first image field ("image" once decoded; jpg, png, seg.PNG, ...), or None."""
    return next((key for key in sample if is_image(key)), None)
