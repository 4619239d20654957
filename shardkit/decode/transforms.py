"""Decoding straight to a training size: `resized` / `resized_tensor` (shorter side to
`size`, then a center crop, letting libjpeg scale down in the DCT domain first), the
geometry they share, and `image_transform`, the picklable transform that packages them."""

from __future__ import annotations

import math
import operator
from typing import Any, Union

import numpy as np
from PIL import Image

from . import jpeg
from ..errors import FieldError, describe
from .fields import check_backend, image_field, open_image, to_chw, to_rgb

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
    check_backend(backend)
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
        return to_chw(fast)  # numpy's copy: torch's would split it over its intra-op threads
    return to_chw(resized(data, size, crop, resample=resample, reducing_gap=reducing_gap, backend="pil"))


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
