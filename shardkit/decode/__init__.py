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

The decoder and the sample's fields are `fields.py`; decoding to size is `transforms.py`.
"""

from __future__ import annotations

from .fields import (
    BACKENDS,
    EXT,
    IMAGE,
    IMAGE_FIELDS,
    MODES,
    Sample,
    decoder,
    image_field,
    is_image,
    open_image,
    packed_from,
    sample_dict,
    to_rgb,
    warm_up,
    with_image,
)
from .transforms import (
    BILINEAR,
    ImageTransform,
    Size,
    center_offset,
    geometry,
    image_transform,
    resized,
    resized_tensor,
)

__all__ = [
    "MODES",
    "BACKENDS",
    "IMAGE",
    "EXT",
    "IMAGE_FIELDS",
    "decoder",
    "sample_dict",
    "Sample",
    "with_image",
    "packed_from",
    "image_field",
    "is_image",
    "open_image",
    "to_rgb",
    "warm_up",
    "Size",
    "BILINEAR",
    "resized",
    "resized_tensor",
    "geometry",
    "center_offset",
    "ImageTransform",
    "image_transform",
]
