"""User transforms named ``module:function`` (`Transform`, shared by `shardkit bench` and
`shardkit preview`: it pickles by name) and the bench's default transform, `ResizeTransform`."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np

from ..decode import image_field, to_rgb
from ..errors import FieldError, ShardkitError, describe

IMAGE_SIZE = 224  # the default transform resizes every image to this square, so batches collate


def load_function(spec: str) -> Callable[..., Any]:
    """The function named by ``module:function`` or ``path/to/file.py:function``.
    Raises ValueError with a one-line message naming what could not be found."""
    module_name, sep, name = spec.rpartition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"{spec!r}: expected module:function or path/to/file.py:function")
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        path = Path(module_name)
        if not path.is_file():
            raise ValueError(f"{module_name}: no such file")
        key = f"_shardkit_user_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]}"
        module = sys.modules.get(key)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(key, path)
            if loader_spec is None or loader_spec.loader is None:
                raise ValueError(f"{module_name}: not a Python file")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[key] = module  # so classes and pickles defined there resolve
            try:
                loader_spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[key]
                raise ValueError(f"{module_name}: {type(e).__name__}: {e}") from None
    else:
        try:
            module = _import(module_name)
        except ModuleNotFoundError as e:
            raise ValueError(f"cannot import module {module_name!r}: {e}") from None
        except Exception as e:  # the module's own code failed
            raise ValueError(f"module {module_name!r}: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{module_name} has no function {name!r}")
    return cast(Callable[..., Any], fn)


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        # the console script does not put the working directory on sys.path, `python -m` does
        cwd = os.getcwd()
        if e.name is None or not name.startswith(e.name) or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        return importlib.import_module(name)


class TransformError(ShardkitError):
    """The user's --transform raised."""


class Transform:
    """A user's sample transform named by ``module:function``: loaded (and so checked) now,
    pickled by name, so it reaches DataLoader workers under spawn as well as fork."""

    def __init__(self, spec: str):
        module_name, _, name = spec.rpartition(":")
        if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
            spec = f"{Path(module_name).resolve()}:{name}"  # workers may start elsewhere
        self.spec = spec
        self.fn = load_function(spec)

    def __call__(self, sample: Any) -> Any:
        try:
            return self.fn(sample)
        except FieldError:
            raise  # bad data it found (image_transform decoding the image): the reader names or skips it
        except Exception as e:  # noqa: BLE001 - the user's code: named, with the sample, in one line
            key = sample.get("__key__") if isinstance(sample, dict) else None
            raise TransformError(f"--transform {self.spec} failed on sample {key}: {describe(e)}") from e

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self.spec}

    def __setstate__(self, state: dict[str, Any]) -> None:
        Transform.__init__(self, state["spec"])

    def __repr__(self) -> str:
        return self.spec


def to_chw(image: Any) -> Any:
    """A CHW uint8 torch tensor from a tensor (CHW), an HWC numpy array or a PIL image."""
    import torch

    if isinstance(image, torch.Tensor):
        return image
    if not isinstance(image, np.ndarray):  # PIL
        image = np.asarray(to_rgb(image))
    if image.ndim == 2:
        image = image[:, :, None]
    return torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1)))


class ResizeTransform:
    """The default bench transform: sample -> (its first image as a CHW uint8 tensor resized
    to `size` x `size`, cls), so batches of differently sized images collate. With
    ``decode="raw"`` it returns (number of image bytes, cls): reading alone is measured."""

    def __init__(self, size: int = IMAGE_SIZE):
        self.size = size

    def __call__(self, sample: dict[str, Any]) -> tuple[Any, int]:
        import torch
        import torch.nn.functional as F

        key = image_field(sample)
        if key is None:
            raise TransformError(f"sample {sample.get('__key__')} has no image field (give --transform)")
        label = int(sample.get("cls", -1))
        image = sample[key]
        if isinstance(image, (bytes, bytearray, memoryview)):
            return len(image), label
        chw = to_chw(image)
        if tuple(chw.shape[-2:]) != (self.size, self.size):
            resized = F.interpolate(
                chw[None].float(), size=(self.size, self.size), mode="bilinear", align_corners=False
            )
            chw = resized[0].round_().clamp_(0, 255).to(torch.uint8)
        return chw, label

    def __repr__(self) -> str:
        return f"default: first image resized to {self.size}x{self.size} (its byte count with decode raw), cls"
