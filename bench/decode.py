"""Where a JPEG's time goes on the fast path (docs/decoding.md), what bounds it, and whether it
beats PIL in every process that runs it.

Photos preloaded as bytes, no loader; each step timed over all photos, the steps taking turns
10 photos at a time (the order turning), round after round; medians with min-max in ms per
photo, and each step's images/s against the PIL decode limit's code (bench/readers.py decode_resize)
in the same round.

Settings, one table row each, image_transform(256, crop=224) against the PIL code, timed in
the same round, settings interleaved too:

- inside a DataLoader worker (num_workers=1, which sets torch to one thread);
- in the main process with torch's default threads (num_workers=0, a notebook, a script);
- the same with CPU hogs beside it (`--hogs`, default 1: processes spinning on a core, started
  by the benchmark for that setting's turn and stopped after it), a busy machine;
- in the main process on one torch thread, where the steps below are timed too:
  - the PIL decode limit's code, image_transform(256, crop=224) fast and with backend="pil";
  - the fast path's parts: simplejpeg's decode as shardkit runs it (accurate DCT, PIL's
    pixels), torch's antialiased resize + center crop of photos decoded in advance;
  - what bounds the decode: at 1/8 scale libjpeg-turbo still entropy-decodes every
    coefficient but does almost no inverse DCT or colour conversion;
  - an idea put aside: the fast integer DCT (`fastdct=True`), with its agreement with PIL's
    resize (mean absolute difference, worst photo, lowest PSNR) beside the shipped path's.

    python -m bench.decode --images 400 --rounds 5
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from bench.readers import decode_resize, ranged, start_clock
from scripts.make_images import make_image_folder
from shardkit.bench.harness import median, ratio_spread, rotate

PIL_LIMIT = "PIL decode limit's code (decode + resize to 224)"
FAST = "image_transform(256, crop=224)"


Steps = dict[str, tuple[Callable[[Any], object], list]]  # name -> (function of one input, its inputs)


def pair(blobs: list[bytes]) -> Steps:
    """The PIL decode limit's code and image_transform(256, crop=224)."""
    from shardkit.decode import image_transform

    samples = [{"jpg": b, "cls": 0} for b in blobs]
    return {PIL_LIMIT: (decode_resize, blobs), FAST: (image_transform(256, crop=224), samples)}


def steps(blobs: list[bytes]) -> Steps:
    """The pair, and the fast path's parts."""
    import simplejpeg

    from shardkit.decode import jpeg
    from shardkit.decode import image_transform

    pil = image_transform(256, crop=224, backend="pil")
    decoded = [jpeg.decode(b) for b in blobs]
    samples = [{"jpg": b, "cls": 0} for b in blobs]
    return {
        **pair(blobs),
        "image_transform(256, crop=224, backend='pil')": (pil, samples),
        "simplejpeg decode (the fast path's)": (jpeg.decode, blobs),
        "simplejpeg decode at 1/8 scale (entropy decoding)": (
            lambda b: simplejpeg.decode_jpeg(b, "RGB", min_width=1, min_height=1, min_factor=8),
            blobs,
        ),
        "simplejpeg decode, fastdct=True (put aside)": (
            lambda b: simplejpeg.decode_jpeg(b, "RGB", fastdct=True),
            blobs,
        ),
        "torch resize 256 + crop 224 (decoded photos)": (resize_crop, decoded),
    }


def resize_crop(hwc: np.ndarray, size: int = 256, crop: int = 224) -> torch.Tensor:
    """What the fast path does after decoding (jpeg.resize, then torchvision's center crop),
    as a CHW contiguous tensor."""
    from shardkit.decode import jpeg
    from shardkit.decode import BILINEAR, center_offset, geometry

    full, out, _ = geometry((hwc.shape[1], hwc.shape[0]), size, crop)
    left, top = center_offset(full, out)
    hwc = jpeg.resize(hwc, full, BILINEAR)[top : top + out[1], left : left + out[0]].numpy()
    return torch.from_numpy(np.ascontiguousarray(hwc.transpose(2, 0, 1)))  # numpy's copy, as the fast path's


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
        mse = (diff**2).mean()
        psnrs.append(10 * math.log10(255**2 / mse) if mse else math.inf)
    return f"{statistics.mean(mads):.3f} | {max(mads):.3f} | {min(psnrs):.1f} dB"


def race(todo: Steps, r: int, block: int = 10) -> dict[str, float]:
    """One round: ms per input of each step. The steps take turns `block` inputs at a time (the
    order turning each turn, from round r's), so that a machine whose load drifts by the second
    slows them alike; every step's inputs are the same photos in the same order."""
    names, total = rotate(list(todo), r), dict.fromkeys(todo, 0.0)
    count = len(next(iter(todo.values()))[1])
    start_clock()  # one full collection first
    for turn, lo in enumerate(range(0, count, block)):
        for name in rotate(names, turn):
            fn, inputs = todo[name]
            start = time.perf_counter()
            for x in inputs[lo : lo + block]:
                fn(x)
            total[name] += time.perf_counter() - start
    return {name: total[name] / count * 1000 for name in todo}


def warmed(todo: Steps) -> Steps:
    for fn, inputs in todo.values():  # imports, first-call set-up
        fn(inputs[0])
    return todo


class InWorker(IterableDataset):
    """A dataset whose one item is a round of the race, run inside a DataLoader worker."""

    def __init__(self, blobs: list[bytes], r: int):
        self.blobs, self.r = blobs, r

    def __iter__(self) -> Iterator[dict[str, float]]:
        yield race(warmed(pair(self.blobs)), self.r)


def in_worker(blobs: list[bytes], r: int) -> dict[str, float]:
    """A round in a fresh DataLoader worker (forked, as on Linux by default)."""
    loader = DataLoader(InWorker(blobs, r), batch_size=None, num_workers=1, multiprocessing_context="fork")
    return next(iter(loader))  # type: ignore[no-any-return]


def hogs(n: int) -> list[subprocess.Popen]:
    """n processes spinning on a core each, until killed."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    time.sleep(0.3)  # started and spinning
    return procs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hogs", type=int, default=1, help="CPU hogs beside the busy-machine setting")
    ap.add_argument("--dir", default="/tmp/shardkit-bench", help="where the generated photos go")
    args = ap.parse_args()
    default_threads = torch.get_num_threads()
    paths = make_image_folder(Path(args.dir) / f"photos-{args.images}", args.images, n_classes=10, seed=0)
    blobs = [p.read_bytes() for p in paths]
    todo = warmed(steps(blobs))
    two = {name: todo[name] for name in (PIL_LIMIT, FAST)}
    settings = {
        "inside a DataLoader worker (num_workers=1: one torch thread)": "worker",
        f"main process, torch's default threads ({default_threads})": "default",
        f"main process, torch's default threads ({default_threads}), {args.hogs} CPU hog(s) beside it": "busy",
        "main process, one torch thread (the steps below)": "one",
    }
    by_setting: dict[str, dict[str, list[float]]] = {s: {} for s in settings}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for setting in rotate(list(settings), r):
            kind = settings[setting]
            torch.set_num_threads(1 if kind == "one" else default_threads)
            running = hogs(args.hogs) if kind == "busy" else []
            try:
                ms = in_worker(blobs, r) if kind == "worker" else race(todo if kind == "one" else two, r)
            finally:
                for proc in running:
                    proc.kill()
                    proc.wait()
            for name, value in ms.items():
                by_setting[setting].setdefault(name, []).append(value)
        load.append(os.getloadavg()[0])
        print(f"round {r + 1} done, load {load[-1]:.1f}", file=sys.stderr)
    torch.set_num_threads(default_threads)

    print(
        f"\n{args.images} photos, {sum(map(len, blobs)) / 1e6:.1f} MB, {args.rounds} rounds, {os.cpu_count()} CPUs, "
        f"load average {min(load):.1f}-{max(load):.1f} (1 min, sampled between rounds); median (min-max)\n"
    )
    print(
        "| setting | PIL decode limit's code, images/s | image_transform(256, crop=224), images/s | x PIL, by round |"
    )
    print("|---|---|---|---|")
    for setting, ms in by_setting.items():
        pil, fast = ([1000 / v for v in ms[name]] for name in (PIL_LIMIT, FAST))
        print(f"| {setting} | {ranged(pil)} | {ranged(fast)} | {ratio_spread(fast, pil, '.2f', 'x')} |")

    ms = by_setting["main process, one torch thread (the steps below)"]
    print(
        "\n| step, main process, one torch thread | ms per photo | images/s | "
        "rate against the PIL decode limit's, by round |"
    )
    print("|---|---|---|---|")
    for name, values in ms.items():
        print(
            f"| {name} | {ranged(values, digits=3)} | {1000 / median(values):,.0f} | "
            f"{ratio_spread([1 / v for v in values], [1 / v for v in ms[PIL_LIMIT]])} |"
        )
    med = {name: median(v) for name, v in ms.items()}
    total, decode = med[FAST], med["simplejpeg decode (the fast path's)"]
    resize = med["torch resize 256 + crop 224 (decoded photos)"]
    print(
        f"\nimage_transform: decode {decode / total:.0%}, resize + crop {resize / total:.0%}, the rest "
        f"{(total - decode - resize) / total:.0%}; with a free resize it would be "
        f"{med[PIL_LIMIT] / (total - resize):.2f}x the PIL decode limit, decoding nothing but entropy "
        f"{med[PIL_LIMIT] / med['simplejpeg decode at 1/8 scale (entropy decoding)']:.2f}x"
    )
    print("\n| against PIL's resize (256, crop 224) | mean abs diff | worst photo | lowest PSNR |")
    print("|---|---|---|---|")
    print(f"| the fast path (accurate DCT) | {agreement(blobs, fastdct=False)} |")
    print(f"| fastdct=True (put aside) | {agreement(blobs, fastdct=True)} |")


if __name__ == "__main__":
    main()
