"""Turn a sample's raw fields into Python values, WebDataset style.

Images become bytes ("raw"), PIL images ("pil"), HWC uint8 numpy arrays ("rgb8") or CHW
uint8 torch tensors ("tensor"); `cls` becomes an int, `json` a dict, `txt` a str. Anything
else stays bytes: members are never unpickled or passed to torch.load.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

MODES = ("raw", "pil", "rgb8", "tensor")
IMAGE_FIELDS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "pbm", "pnm", "tif", "tiff", "gif"})
_INT_FIELDS = frozenset({"cls", "cls2", "index", "idx", "label"})
_json = json.JSONDecoder().decode


def _pil(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.draft("RGB", img.size)  # lets libjpeg decode straight to RGB
    return img.convert("RGB")


def _rgb8(data: bytes) -> np.ndarray:
    return np.array(_pil(data))  # writable, unlike np.asarray's view of the PIL buffer


def _tensor(data: bytes) -> Any:
    import torch

    hwc = np.asarray(_pil(data))
    return torch.from_numpy(np.ascontiguousarray(hwc.transpose(2, 0, 1)))


_IMAGE: dict[str, Callable[[bytes], Any]] = {"pil": _pil, "rgb8": _rgb8, "tensor": _tensor}


def decoder(mode: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A function decoding one sample's fields in place. Raises ValueError for unknown modes."""
    if mode not in MODES:
        raise ValueError(f"decode must be one of {MODES}, not {mode!r}")
    handlers: dict[str, Callable[[bytes], Any]] = {ext: int for ext in _INT_FIELDS}
    handlers["json"] = lambda value: _json(value.decode("utf-8"))
    handlers["txt"] = lambda value: value.decode("utf-8")
    image = _IMAGE.get(mode)
    if image is not None:
        handlers.update(dict.fromkeys(IMAGE_FIELDS, image))

    def decode(sample: dict[str, Any]) -> dict[str, Any]:
        for key, value in sample.items():
            if key[0] == "_":  # __key__, __url__
                continue
            handler = handlers.get(key) or handlers.get(key.rsplit(".", 1)[-1])
            if handler is not None:
                sample[key] = handler(value)
        return sample

    return decode
