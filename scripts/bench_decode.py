"""Where a JPEG's time goes on the fast path (docs/decoding.md), and what bounds it.

One process, no loader, photos preloaded as bytes, torch on one thread (as in a DataLoader
worker); each step timed over all photos, the steps interleaved round after round (the order
rotating), medians with min-max in ms per photo, and each step's images/s against the PIL
decode limit's code (bench_read.decode_resize) in the same round:

- the PIL decode limit's code, image_transform(256, crop=224) fast and with backend="pil";
- the fast path's parts: simplejpeg's decode as shardkit runs it (accurate DCT, PIL's
  pixels), torch's antialiased resize + center crop of photos decoded in advance;
- what bounds the decode: at 1/8 scale libjpeg-turbo still entropy-decodes every
  coefficient but does almost no inverse DCT or colour conversion;
- an idea put aside: the fast integer DCT (`fastdct=True`), with its agreement with PIL's
  resize (mean absolute difference, worst photo, lowest PSNR) beside the shipped path's.

    python scripts/bench_decode.py --images 400 --rounds 5
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_read as br  # noqa: E402
from make_images import make_image_folder  # noqa: E402

PIL_LIMIT = "PIL decode limit's code (decode + resize to 224)"


def steps(blobs: list[bytes]) -> dict[str, tuple[object, list]]:
    """name -> (function of one input, its inputs)."""
    import simplejpeg

    from shardkit import jpeg
    from shardkit.decode import image_transform

    fast, pil = image_transform(256, crop=224), image_transform(256, crop=224, backend="pil")
    decoded = [jpeg.decode(b) for b in blobs]
    samples = [{"jpg": b, "cls": 0} for b in blobs]
    return {
        PIL_LIMIT: (br.decode_resize, blobs),
        "image_transform(256, crop=224)": (fast, samples),
        "image_transform(256, crop=224, backend='pil')": (pil, samples),
        "simplejpeg decode (the fast path's)": (jpeg.decode, blobs),
        "simplejpeg decode at 1/8 scale (entropy decoding)": (
            lambda b: simplejpeg.decode_jpeg(b, "RGB", min_width=1, min_height=1, min_factor=8), blobs),
        "simplejpeg decode, fastdct=True (put aside)": (
            lambda b: simplejpeg.decode_jpeg(b, "RGB", fastdct=True), blobs),
        "torch resize 256 + crop 224 (decoded photos)": (resize_crop, decoded),
    }


def resize_crop(hwc: np.ndarray, size: int = 256, crop: int = 224) -> "torch.Tensor":  # noqa: F821
    """What the fast path does after decoding (jpeg.resize, then torchvision's center crop),
    as a CHW contiguous tensor."""
    from shardkit import jpeg
    from shardkit.decode import BILINEAR, center_offset, geometry

    full, out, _ = geometry((hwc.shape[1], hwc.shape[0]), size, crop)
    left, top = center_offset(full, out)
    return jpeg.resize(hwc, full, BILINEAR)[top:top + out[1], left:left + out[0]].permute(2, 0, 1).contiguous()


def agreement(blobs: list[bytes], fastdct: bool) -> str:
    """Mean absolute difference (mean over photos, worst photo) and lowest PSNR of the
    decode + resize + crop against PIL's (`resized(..., backend="pil", reducing_gap=None)`)."""
    import simplejpeg

    from shardkit.decode import resized

    mads, psnrs = [], []
    for b in blobs:
        ref = np.asarray(resized(b, 256, 224, backend="pil", reducing_gap=None), dtype=np.float64)
        got = resize_crop(simplejpeg.decode_jpeg(b, "RGB", fastdct=fastdct))
        diff = np.abs(got.permute(1, 2, 0).numpy().astype(np.float64) - ref)
        mads.append(diff.mean())
        mse = (diff ** 2).mean()
        psnrs.append(10 * math.log10(255 ** 2 / mse) if mse else math.inf)
    return f"{statistics.mean(mads):.3f} | {max(mads):.3f} | {min(psnrs):.1f} dB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/shardkit-bench", help="where the generated photos go")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    paths = make_image_folder(Path(args.dir) / f"photos-{args.images}", args.images, n_classes=10, seed=0)
    blobs = [p.read_bytes() for p in paths]
    todo = steps(blobs)
    for fn, inputs in todo.values():  # warm: imports, first-call set-up
        fn(inputs[0])  # type: ignore[operator]
    ms: dict[str, list[float]] = {name: [] for name in todo}
    for r in range(args.rounds):
        for name in br.rotate(list(todo), r):
            fn, inputs = todo[name]
            start = br.start_clock()
            for x in inputs:
                fn(x)  # type: ignore[operator]
            ms[name].append((time.perf_counter() - start) / len(inputs) * 1000)

    print(f"\n{args.images} photos, {sum(map(len, blobs)) / 1e6:.1f} MB, {args.rounds} rounds, one process; "
          "median (min-max)\n")
    print("| step | ms per photo | images/s | rate against the PIL decode limit's, by round |")
    print("|---|---|---|---|")
    for name, values in ms.items():
        print(f"| {name} | {br._fmt(values, digits=3)} | {1000 / statistics.median(values):,.0f} | "
              f"{br.ratio([1 / v for v in values], [1 / v for v in ms[PIL_LIMIT]])} |")
    med = {name: statistics.median(v) for name, v in ms.items()}
    total, decode = med["image_transform(256, crop=224)"], med["simplejpeg decode (the fast path's)"]
    resize = med["torch resize 256 + crop 224 (decoded photos)"]
    print(f"\nimage_transform: decode {decode / total:.0%}, resize + crop {resize / total:.0%}, the rest "
          f"{(total - decode - resize) / total:.0%}; with a free resize it would be "
          f"{med[PIL_LIMIT] / (total - resize):.2f}x the PIL decode limit, decoding nothing but entropy "
          f"{med[PIL_LIMIT] / med['simplejpeg decode at 1/8 scale (entropy decoding)']:.2f}x")
    print("\n| against PIL's resize (256, crop 224) | mean abs diff | worst photo | lowest PSNR |")
    print("|---|---|---|---|")
    print(f"| the fast path (accurate DCT) | {agreement(blobs, fastdct=False)} |")
    print(f"| fastdct=True (put aside) | {agreement(blobs, fastdct=True)} |")


if __name__ == "__main__":
    main()
