"""Turn a sample's raw fields into Python values, WebDataset style.

Images become bytes ("raw"), PIL images ("pil"), HWC uint8 numpy arrays ("rgb8") or CHW
uint8 torch tensors ("tensor"). Decoded, a sample's (first) image moves to the field "image"
whatever its extension, which "__ext__" keeps ("jpg", "png", "seg.png"), so a DataLoader's
default collate batches a folder of mixed formats; `sample["jpg"]` still reads it. The other fields follow webdataset's default decoders:
`cls cls2 index inx id` become ints, `json jsn` dicts, `txt text transcript`
strs. Anything else stays bytes: members are never unpickled or passed to torch.load.

Decoding less: `resized` / `resized_tensor` decode an image straight to its training size
(shorter side to `size`, then a center crop), letting libjpeg scale down in the DCT domain
first; `image_transform(size, crop)` packages that as a picklable transform for
`StreamingDataset(decode="raw", transform=...)`.

JPEG takes the fast path of `jpeg.py` ("rgb8" and "tensor" decode to PIL's very pixels,
resizing uses PIL's filters on torch's SIMD kernels, or PIL's own where torch has none, on the
calling thread either way); everything else, and `backend="pil"`, is PIL's.
"""

from __future__ import annotations

import functools
import io
import operator
import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, Union

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


def _chw(img: Image.Image | np.ndarray) -> Any:
    import torch

    chw = np.asarray(img).transpose(2, 0, 1)
    # a copy, writable (np.asarray of a PIL image is a read-only view); ascontiguousarray
    # would hand back the read-only view itself where the transpose is already contiguous (1x1)
    return torch.from_numpy(np.array(chw, order="C"))


def _tensor(data: bytes) -> Any:
    return _chw(_pil(data))


def _fast_rgb8(data: bytes) -> np.ndarray:
    hwc = jpeg.decode(data)
    return _rgb8(data) if hwc is None else hwc


def _fast_tensor(data: bytes) -> Any:
    hwc = jpeg.decode(data)
    return _tensor(data) if hwc is None else _chw(hwc)


_IMAGE: dict[str, Callable[[bytes], Any]] = {"pil": _pil, "rgb8": _rgb8, "tensor": _tensor}
_FAST: dict[str, Callable[[bytes], Any]] = {"rgb8": _fast_rgb8, "tensor": _fast_tensor}


def _check_backend(backend: str) -> None:
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
    np.asarray(_pil(buf.getvalue()).resize((8, 8), BILINEAR))
    jpeg.decode(buf.getvalue())  # imports simplejpeg before the fork


def decoder(mode: str, backend: str = "auto") -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A function decoding one sample's fields in place (images by the fast path for JPEG
    unless `backend="pil"`). Raises ValueError for unknown modes and backends."""
    if mode not in MODES:
        raise ValueError(f"decode must be one of {MODES}, not {mode!r}")
    _check_backend(backend)
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


# ------------------------------------------------------------------ decode straight to size

Size = Union[int, tuple[int, int]]  # an int is the shorter side; a pair is (width, height), as in PIL
BILINEAR = Image.Resampling.BILINEAR  # torchvision's Resize default (PIL always antialiases)


def _size(size: Any) -> Size:
    """`size` as an int or a (width, height) tuple of ints; numpy ints and length-2 arrays or
    sequences are taken too, strs ('256' is not the pair ('2', '5')) and floats are not."""
    try:
        if isinstance(size, (str, bytes, bool)):
            raise TypeError
        if not hasattr(size, "__len__"):
            return operator.index(size)
        if len(size) == 2 and not any(isinstance(n, (str, bytes, bool)) for n in size):
            return operator.index(size[0]), operator.index(size[1])
    except TypeError:
        pass
    raise TypeError(f"a size is an int (the shorter side) or a (width, height) pair of ints, not {size!r}")


def _pair(size: Size) -> tuple[int, int]:
    size = _size(size)
    return (size, size) if isinstance(size, int) else size


def _check(size: Size, crop: Size | None, reducing_gap: float | None, backend: str = "auto") -> None:
    _check_backend(backend)
    if reducing_gap is not None and not (math.isfinite(reducing_gap) and reducing_gap >= 1.0):
        raise ValueError(f"reducing_gap must be None or at least 1.0, not {reducing_gap!r}")
    if min(_pair(size)) < 1 or (crop is not None and min(_pair(crop)) < 1):
        raise ValueError(f"size and crop must be positive, not {size!r} and {crop!r}")
    if crop is not None and any(c > s for c, s in zip(_pair(crop), _pair(size))):
        raise ValueError(f"crop {crop!r} is larger than the resized image ({size!r})")


def geometry(
    source: tuple[int, int], size: Size, crop: Size | None = None
) -> tuple[tuple[int, int], tuple[int, int], tuple[float, float, float, float]]:
    """For a `source` (width, height): the resized size, the output size, and the box in
    source pixels that ends up in the output.

    Resizing follows torchvision: an int `size` is the shorter side (the longer one is
    truncated, keeping the aspect), a pair is (width, height). The center crop is taken at
    round((resized - crop) / 2), as torchvision's CenterCrop does.
    """
    w, h = source
    size = _size(size)
    if isinstance(size, int):
        rw, rh = (size, int(size * h / w)) if w <= h else (int(size * w / h), size)
    else:
        rw, rh = size
    if crop is None:
        return (rw, rh), (rw, rh), (0.0, 0.0, float(w), float(h))
    cw, ch = _pair(crop)
    left, top = center_offset((rw, rh), (cw, ch))
    sx, sy = w / rw, h / rh
    return (rw, rh), (cw, ch), (left * sx, top * sy, (left + cw) * sx, (top + ch) * sy)


def center_offset(full: tuple[int, int], out: tuple[int, int]) -> tuple[int, int]:
    """(left, top) of a center crop to `out` from an image of size `full`."""
    return int(round((full[0] - out[0]) / 2.0)), int(round((full[1] - out[1]) / 2.0))


def _fast_resized(
    data: bytes | bytearray | memoryview | Image.Image,
    size: Size,
    crop: Size | None,
    resample: int,
    reducing_gap: float | None,
    backend: str,
) -> np.ndarray | None:
    """`resized` by the fast path, as HWC uint8 pixels (maybe a view), or None where it is PIL's
    to do: decoded in the DCT domain to at least `reducing_gap` times the resized size, then
    resized and cropped (torchvision's Resize and CenterCrop) with PIL's antialiased filter on
    torch's SIMD kernel (`jpeg.can_resize`), or else by PIL itself, from the decoded pixels and
    PIL's own box: PIL's very pixels. Neither starts a torch intra-op thread, which in a main
    process with torch's default threads, on a busy machine, made a resize several times slower."""
    if backend != "auto" or isinstance(data, Image.Image):
        return None
    source = jpeg.header(data)
    if source is None:
        return None
    full, out, box = geometry(source, size, crop)
    # as much as PIL's draft asks for; all of it without a reducing_gap
    at_least = None if reducing_gap is None else (int(full[0] * reducing_gap), int(full[1] * reducing_gap))
    if jpeg.can_resize(resample):
        image = jpeg.resized(data, full, at_least, resample)
        if image is None:
            return None
        left, top = center_offset(full, out)
        return image[top : top + out[1], left : left + out[0]].numpy()
    decoded = jpeg.decode_spanning(data, at_least)
    if decoded is None:
        return None
    hwc, span_w, span_h = decoded  # the box in the decoded pixels, as `resized` maps it into PIL's drafted ones
    fx, fy = span_w / source[0], span_h / source[1]
    box = (box[0] * fx, box[1] * fy, box[2] * fx, box[3] * fy)
    return np.asarray(Image.fromarray(hwc).resize(out, resample, box=box, reducing_gap=reducing_gap))


def resized(
    data: bytes | bytearray | memoryview | Image.Image,
    size: Size,
    crop: Size | None = None,
    *,
    resample: int = BILINEAR,
    reducing_gap: float | None = 2.0,
    backend: str = "auto",
) -> Image.Image:
    """Decode an image and return it resized so its shorter side is `size` (or to exactly
    `size` = (width, height)), center-cropped to `crop` (an int for a square), as RGB.

    One resampling step replaces decode, resize, crop: only the region that survives the
    crop is resampled, and a JPEG is decoded already scaled down by 1/2, 1/4 or 1/8 in the
    DCT domain, as far as keeps it at least `reducing_gap` times the resized size. Then
    PIL's `reducing_gap` pre-reduction (a box filter by whole factors) applies to what is
    still larger than that. As in PIL's `thumbnail`, 2.0 stays within a few levels of the
    exact two-step result, larger is closer and slower, None resamples the full image exactly.

    A JPEG takes the fast path (see `jpeg.py`) unless `backend="pil"`: decoded by
    libjpeg-turbo in the DCT domain as above, then resized exactly with a bilinear or bicubic
    `resample` on torch's SIMD kernel (x86-64), within a level of PIL's pixels on average, or
    else by PIL from the decoded pixels, PIL's very pixels. It starts no torch intra-op thread.
    """
    _check(size, crop, reducing_gap, backend)
    fast = _fast_resized(data, size, crop, resample, reducing_gap, backend)
    if fast is not None:
        return Image.fromarray(np.ascontiguousarray(fast))
    img = data if isinstance(data, Image.Image) else open_image(data)
    source = img.size
    full, out, box = geometry(source, size, crop)
    drafted = None
    if reducing_gap is not None:  # JPEG only, and only before the pixels are loaded
        drafted = img.draft("RGB", (int(full[0] * reducing_gap), int(full[1] * reducing_gap)))
    if drafted is not None and img.size != source:  # box: the source's extent in the drafted pixels
        fx, fy = drafted[1][2] / source[0], drafted[1][3] / source[1]
        box = (box[0] * fx, box[1] * fy, box[2] * fx, box[3] * fy)
    return to_rgb(img).resize(out, resample, box=box, reducing_gap=reducing_gap)


def resized_tensor(
    data: bytes | bytearray | memoryview | Image.Image,
    size: Size,
    crop: Size | None = None,
    *,
    resample: int = BILINEAR,
    reducing_gap: float | None = 2.0,
    backend: str = "auto",
) -> Any:
    """`resized` as a CHW uint8 torch tensor."""
    _check(size, crop, reducing_gap, backend)
    fast = _fast_resized(data, size, crop, resample, reducing_gap, backend)
    if fast is not None:
        return _chw(fast)  # numpy's copy: torch's would split it over its intra-op threads
    return _chw(resized(data, size, crop, resample=resample, reducing_gap=reducing_gap, backend="pil"))


def is_image(field: str) -> bool:
    """Whether the decoders take `field` for an image (jpg, png, seg.PNG, pbm, ...), or it
    holds a decoded one ("image")."""
    return field == IMAGE or (not field.startswith("_") and _kind(field) in IMAGE_FIELDS)


def image_field(sample: dict[str, Any]) -> str | None:
    """The sample's first image field ("image" once decoded; jpg, png, seg.PNG, ...), or None."""
    return next((key for key in sample if is_image(key)), None)


class ImageTransform:
    """sample -> (CHW uint8 tensor of the resized, center-cropped image, label); see `resized`.

    Made for `StreamingDataset(decode="raw", transform=ImageTransform(256, 224))`: the
    image is decoded once, straight to its training size, in the DataLoader worker. A
    plain object, so it pickles for spawned workers. Also accepts samples decoded to PIL.
    """

    def __init__(
        self,
        size: Size = 256,
        crop: Size | None = 224,
        *,
        field: str | None = None,
        label: str = "cls",
        resample: int = BILINEAR,
        reducing_gap: float | None = 2.0,
        backend: str = "auto",
    ):
        _check(size, crop, reducing_gap, backend)
        self.size, self.crop = _size(size), None if crop is None else _size(crop)
        self.field, self.label = field, label
        self.resample, self.reducing_gap, self.backend = int(resample), reducing_gap, backend

    def __call__(self, sample: dict[str, Any]) -> tuple[Any, Any]:
        field = self.field or image_field(sample)
        if field is None or sample.get(field) is None:  # bad data, as an undecodable image is
            raise FieldError(
                f"no image field{f' {field!r}' if field else ''} in sample {sample.get('__key__')!r} "
                f"(fields: {', '.join(sample)})"
            )
        image = sample[field]
        if not isinstance(image, (bytes, bytearray, memoryview, Image.Image)):
            raise TypeError(
                f"image_transform decodes the image itself: it takes samples read with decode='raw' "
                f"(or 'pil'), not a {type(image).__module__}.{type(image).__name__}"
            )
        try:
            tensor = resized_tensor(
                image,
                self.size,
                self.crop,
                resample=self.resample,
                reducing_gap=self.reducing_gap,
                backend=self.backend,
            )
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:  # PIL's words for bad data
            raise FieldError(f"field {field!r}: {describe(e)}") from e  # bad data: named and skippable by the reader
        if self.label not in sample:
            raise FieldError(
                f"sample {sample.get('__key__')!r} has no field {self.label!r} for the label "
                f"(fields: {', '.join(sample)})"
            )
        return tensor, sample[self.label]

    def __repr__(self) -> str:
        return f"ImageTransform(size={self.size!r}, crop={self.crop!r})"


def image_transform(size: Size = 256, crop: Size | None = 224, **options: Any) -> ImageTransform:
    """A picklable transform for `StreamingDataset(decode="raw", transform=...)`: the
    sample's image, resized so its shorter side is `size` and center-cropped to `crop`, as a
    CHW uint8 tensor, paired with its `cls`. Options: field, label, resample, reducing_gap,
    backend ("pil" for PIL's exact pixels; see `resized`)."""
    return ImageTransform(size, crop, **options)
