"""The fast path for JPEG: libjpeg-turbo through simplejpeg, PIL's resampling filters through torch.

PIL decodes JPEG with libjpeg-turbo too, but spends about as long again around it, and its
resize (the antialiased filters that torch implements with SIMD, to match PIL) is slower
still. Here a JPEG decodes to the very pixels PIL gives (same library, same settings), scaled
down in the DCT domain where that keeps at least the size asked for (as PIL's `draft`), and
resizes with torch's antialiased bilinear or bicubic kernels on uint8 where torch has them in
SIMD (x86-64 with AVX2): pillow-simd's code, run on the calling thread alone. Elsewhere (ARM,
older x86) torch's generic kernel is slower than PIL's own and splits each image over torch's
intra-op threads, which on a busy machine or in a main process with torch's default threads
costs more than it saves; `torch_resizes` says which, and the caller resizes with PIL there.

Every function returns None where the fast path would not give PIL's answer: not a JPEG, CMYK
or YCCK, a header or scan that libjpeg-turbo calls damaged (a truncated file, 12-bit data), or
an image over PIL's decompression-bomb limit. The caller then decodes with PIL, which gives
its own pixels or its own error. simplejpeg and torch are imported on first use.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    import torch

_SOI = b"\xff\xd8\xff"  # start of image, then the first marker
_COLORSPACES = frozenset({"YCbCr", "RGB", "Gray"})  # not CMYK, YCCK: PIL converts those its own way
MODES: dict[int, str] = {Image.Resampling.BILINEAR: "bilinear", Image.Resampling.BICUBIC: "bicubic"}  # PIL's -> torch's
_SIMD = frozenset(
    {"AVX2", "AVX512"}
)  # torch's CPU capabilities with the uint8 antialiased kernel (AVX-512 runs AVX2's)


@functools.cache
def torch_resizes() -> bool:
    """Whether torch is installed and resizes uint8 with its SIMD antialiased kernel, which
    runs on the calling thread alone (`interpolate` of one image starts no intra-op thread)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.backends.cpu.get_cpu_capability() in _SIMD


def can_resize(resample: int) -> bool:
    """Whether the fast path resizes with this PIL filter on torch: bilinear or bicubic, where
    `torch_resizes`; PIL's to resize (the decoded pixels) otherwise."""
    return resample in MODES and torch_resizes()


def header(data: bytes | bytearray | memoryview) -> tuple[int, int] | None:
    """(width, height) of a JPEG the fast path decodes as PIL would, else None."""
    if bytes(data[:3]) != _SOI:
        return None
    import simplejpeg

    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:  # a header libjpeg-turbo cannot read (or a subsampling it does not name): PIL's turn
        return None
    limit = Image.MAX_IMAGE_PIXELS
    if colorspace not in _COLORSPACES or (limit is not None and width * height > limit):
        return None  # a bomb: PIL warns or refuses, its way
    return width, height


def decode(data: bytes | bytearray | memoryview, at_least: tuple[int, int] | None = None) -> np.ndarray | None:
    """A JPEG as HWC uint8 RGB, in full or scaled down by 1/2, 1/4 or 1/8 in the DCT domain
    as far as keeps it at least `at_least` (width, height), as PIL's `draft` does; None where
    PIL must decode it."""
    decoded = decode_spanning(data, at_least)
    return None if decoded is None else decoded[0]


def decode_spanning(
    data: bytes | bytearray | memoryview, at_least: tuple[int, int] | None = None
) -> tuple[np.ndarray, float, float] | None:
    """`decode`'s pixels, and the source's width and height in them (a scaled decode rounds up:
    ceil(width / 4) pixels hold width / 4 of the source), as PIL's `draft` box gives them."""
    source = header(data)
    if source is None:
        return None
    import simplejpeg

    # PIL's draft rule: the largest of 1/8, 1/4, 1/2 that keeps source // k >= at_least. libjpeg-turbo
    # also scales by 3/8, 5/8...: those shift the pixels by a fraction, so ask for the size
    # that k gives (rounded up, as libjpeg does), which no other factor reaches
    scale = next((k for k in (8, 4, 2) if all(s // k >= n for s, n in zip(source, at_least or source))), 1)
    try:  # strict: what libjpeg-turbo only warns about (a truncated scan) is PIL's to judge
        hwc = simplejpeg.decode_jpeg(
            data, "RGB", min_width=-(-source[0] // scale), min_height=-(-source[1] // scale), strict=True
        )
    except ValueError:
        return None
    return hwc, source[0] / scale, source[1] / scale


def warning(data: bytes | bytearray | memoryview, scale: int = 1) -> str | None:
    """What libjpeg-turbo warns of as it decodes a JPEG the fast path takes (at 1/`scale`, 1
    to 8: the whole scan is read whatever the scale), raised by its strict mode: "" where it
    decodes with no warning, None where the fast path does not take it (PIL's to judge)."""
    source = header(data)
    if source is None:
        return None
    import simplejpeg

    try:
        simplejpeg.decode_jpeg(
            data, "RGB", min_width=-(-source[0] // scale), min_height=-(-source[1] // scale), strict=True
        )
    except ValueError as e:
        return str(e) or "a warning"
    return ""


def resized(
    data: bytes | bytearray | memoryview, size: tuple[int, int], at_least: tuple[int, int] | None, resample: int
) -> torch.Tensor | None:
    """A JPEG decoded as `decode(data, at_least)` does, then resized to `size` (width, height)
    with PIL's antialiased `resample` filter (bilinear or bicubic): an HWC uint8 tensor (a view,
    maybe not contiguous), or None where PIL must decode it."""
    decoded = decode_spanning(data, at_least)
    return None if decoded is None else resize(decoded[0], size, resample, decoded[1:])


def resize(
    hwc: np.ndarray, size: tuple[int, int], resample: int, span: tuple[float, float] | None = None
) -> torch.Tensor:
    """HWC uint8 pixels resized to `size` (width, height) with PIL's antialiased `resample`
    filter (bilinear or bicubic): an HWC uint8 tensor (a view, maybe not contiguous). `span`:
    the source's width and height in these pixels (a scaled decode's may end inside its last
    pixel); their own size by default."""
    import torch

    width, height = span or (hwc.shape[1], hwc.shape[0])
    chw = torch.from_numpy(hwc).permute(2, 0, 1)
    if chw.shape[1:] == (size[1], size[0]) == (height, width):
        return chw.permute(1, 2, 0)
    # Scale factors, not a size, map the source's span onto `size`; the nudge keeps the output,
    # rounded down by torch, from falling short by float error (a pixel too many is cut off below).
    factors = (size[1] / height * (1 + 1e-9), size[0] / width * (1 + 1e-9))
    out = torch.nn.functional.interpolate(chw[None], scale_factor=factors, mode=MODES[resample], antialias=True)
    return out[0, :, : size[1], : size[0]].permute(1, 2, 0)
