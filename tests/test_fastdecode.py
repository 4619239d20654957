"""The fast JPEG path (shardkit/decode/jpeg.py) against PIL: the same pixels where it decodes, the
same pixels within a level where it resizes, PIL's own answer (pixels or error) elsewhere."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
import torch
from make_images import make_image_folder
from PIL import Image, ImageFile, ImageOps
from test_decode import _tar_of

from shardkit import CorruptShardError, LMDBDataset, StreamingDataset
from shardkit.decode import jpeg
from shardkit.errors import FieldError
from shardkit.decode import decoder, geometry, image_transform, resized, resized_tensor
from shardkit.packing import images

CASES = [(256, 224), (160, 128), (96, None), ((200, 150), None), ((300, 240), (256, 192))]


def encode(img: Image.Image, fmt: str = "JPEG", **options: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **options)
    return buf.getvalue()


@pytest.fixture(scope="module")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[bytes]]:
    """Photo crops as the generator writes them (ImageNet-like, 300-500 px, 4:4:4) and
    re-encoded as cameras do (4:2:0), large (where DCT scaling applies) and at odd sizes
    (a scaled decode then ends inside its last pixel)."""
    root = tmp_path_factory.mktemp("fast")
    medium = [p.read_bytes() for p in make_image_folder(root / "m", 4, 2, seed=3, workers=1)]
    rgb = [Image.open(io.BytesIO(d)).convert("RGB") for d in medium]
    large = [encode(img.resize((2001 - 40 * i, 1503 + 8 * i)), quality=90) for i, img in enumerate(rgb[:2])]
    odd = [encode(img.resize((517, 389)), quality=85, subsampling=1) for img in rgb[2:]]
    return {"medium": medium, "large": large, "odd": odd}


@pytest.fixture
def fast_decodes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes simplejpeg decoded, as they happen: proof the fast path ran."""
    shapes: list[tuple[int, ...]] = []
    real = simplejpeg.decode_jpeg

    def spy(*args: object, **kwargs: object) -> np.ndarray:
        out = real(*args, **kwargs)
        shapes.append(out.shape)
        return out

    monkeypatch.setattr(simplejpeg, "decode_jpeg", spy)
    return shapes


def variants(img: Image.Image) -> Iterator[tuple[str, bytes]]:
    """JPEGs as they come: subsamplings, qualities, progressive, grayscale, EXIF-rotated."""
    for sub in (0, 1, 2):
        for quality in (75, 95):
            yield f"subsampling {sub} quality {quality}", encode(img, quality=quality, subsampling=sub)
    yield "progressive", encode(img, progressive=True)
    yield "grayscale", encode(img.convert("L"))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: PIL's readers do not apply it, so neither does the fast path
    yield "EXIF orientation 6", encode(img, exif=exif)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def agree(fast: Image.Image, reference: Image.Image, *, mean: float = 1.0, db: float = 40.0) -> None:
    a, b = np.asarray(fast), np.asarray(reference)
    assert a.shape == b.shape
    d = np.abs(a.astype(np.int16) - b.astype(np.int16))
    assert d.mean() <= mean and psnr(a, b) >= db, (d.mean(), psnr(a, b))


def test_rgb8_and_tensor_are_pils_very_pixels(pictures: dict, fast_decodes: list) -> None:
    img = Image.open(io.BytesIO(pictures["medium"][0])).convert("RGB")
    decoders = {(mode, backend): decoder(mode, backend) for mode in ("rgb8", "tensor") for backend in ("auto", "pil")}
    fast_decodes.clear()  # the warm-up's
    for name, data in variants(img):
        for mode in ("rgb8", "tensor"):
            fast, pil = (decoders[mode, backend]({"jpg": data})["jpg"] for backend in ("auto", "pil"))
            fast, pil = np.asarray(fast), np.asarray(pil)
            assert fast.shape == pil.shape and np.array_equal(fast, pil), (name, mode)
            assert fast.flags.writeable, (name, mode)
    assert len(fast_decodes) == 2 * len(list(variants(img)))


@pytest.mark.parametrize("kind", ["medium", "large", "odd"])
@pytest.mark.parametrize(("size", "crop"), CASES)
def test_resized_agrees_with_pil(pictures: dict, fast_decodes: list, kind: str, size: object, crop: object) -> None:
    for data in pictures[kind]:
        agree(resized(data, size, crop), resized(data, size, crop, backend="pil"))  # type: ignore[arg-type]
        exact = resized(data, size, crop, reducing_gap=None, backend="pil")  # type: ignore[arg-type]
        agree(resized(data, size, crop, reducing_gap=None), exact)  # type: ignore[arg-type]
    assert len(fast_decodes) == 2 * len(pictures[kind])


def test_bicubic_and_tensors_agree_too(pictures: dict) -> None:
    bicubic = Image.Resampling.BICUBIC
    for data in pictures["large"] + pictures["medium"]:
        agree(resized(data, 256, 224, resample=bicubic), resized(data, 256, 224, resample=bicubic, backend="pil"))
        tensor = resized_tensor(data, 256, 224)
        assert tensor.is_contiguous() and tensor.shape == (3, 224, 224)
        assert np.array_equal(tensor.permute(1, 2, 0).numpy(), np.asarray(resized(data, 256, 224)))


def test_a_2000px_pattern_downscaled_to_224_stays_antialiased(fast_decodes: list) -> None:
    """A zone plate (rings up to the finest frequency a pixel holds): a 4-tap resize across
    an 8x reduction turns it into bold false rings, an antialiased one into smooth gray."""
    n = 2000
    y, x = np.mgrid[0:n, 0:n]
    zone = (127.5 + 127.5 * np.cos(np.pi * ((x - n / 2) ** 2 + (y - n / 2) ** 2) / (2 * n))).astype(np.uint8)
    data = encode(Image.fromarray(np.stack([zone, zone[::-1], zone.T], -1)), quality=95)
    fast = resized(data, 224)
    assert fast_decodes == [(500, 500, 3)]  # decoded at 1/4, then resized by 2.2
    agree(fast, resized(data, 224, backend="pil"))
    full = Image.open(io.BytesIO(data)).convert("RGB")
    agree(fast, full.resize((224, 224), Image.Resampling.BILINEAR), mean=3.0, db=35.0)  # the exact resize, from 2000 px
    four_tap = torch.nn.functional.interpolate(
        torch.from_numpy(np.array(full)).permute(2, 0, 1)[None], size=(224, 224), mode="bilinear", antialias=False
    )
    aliased = Image.fromarray(four_tap[0].permute(1, 2, 0).numpy())
    with pytest.raises(AssertionError):  # the test can tell aliasing from the real thing
        agree(aliased, resized(data, 224, backend="pil"), mean=20.0, db=20.0)


@pytest.mark.parametrize("resample", [Image.Resampling.LANCZOS, Image.Resampling.BOX, Image.Resampling.NEAREST])
def test_other_filters_decode_fast_and_resize_to_pils_very_pixels(
    pictures: dict, fast_decodes: list, resample: int
) -> None:
    """A filter torch lacks: libjpeg-turbo decodes (scaled as PIL's draft), PIL resizes it with PIL's box."""
    sources = pictures["large"] + pictures["odd"]
    for data in sources:
        for size, crop in CASES:
            fast, pil = (resized(data, size, crop, resample=resample, backend=b) for b in ("auto", "pil"))  # type: ignore[arg-type]
            assert np.array_equal(np.asarray(fast), np.asarray(pil)), (size, crop)
        tensor = resized_tensor(data, 256, 224, resample=resample)
        assert tensor.is_contiguous() and torch.equal(
            tensor, resized_tensor(data, 256, 224, resample=resample, backend="pil")
        )
    assert len(fast_decodes) == len(sources) * (len(CASES) + 1)
    assert (376, 501, 3) in fast_decodes  # 2001x1503 decoded at 1/4 for 96 px, as PIL's draft does


_NO_THREADS = """if True:
    import os, sys
    import numpy as np, torch
    from shardkit.decode import jpeg
    from shardkit.decode import decoder, image_transform, resized, resized_tensor
    torch.set_num_threads(4)  # as a notebook or script has it (torch's default: one per core)
    threads = lambda: len(os.listdir("/proc/self/task"))
    blobs = [open(path, "rb").read() for path in sys.argv[1:]]
    before = threads()
    transform, tensor = image_transform(256, crop=224), decoder("tensor")
    for data in blobs:
        for resample in (2, 3):  # bilinear, bicubic
            resized(data, 256, 224, resample=resample), resized_tensor(data, 160, 128, resample=resample)
        transform({"jpg": data, "cls": 0}), tensor({"jpg": data})
    assert threads() == before, ("torch started intra-op threads", before, threads())
    assert torch.get_num_threads() == 4
    pil = [np.array_equal(np.asarray(resized(d, s, c)), np.asarray(resized(d, s, c, backend="pil")))
           for d in blobs for s, c in [(256, 224), (96, None), ((300, 240), (256, 192))]]
    print(torch.backends.cpu.get_cpu_capability(), jpeg.torch_resizes(), all(pil))
    """


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
@pytest.mark.parametrize("capability", ["", "default"])
def test_the_fast_path_runs_on_the_calling_thread_alone(pictures: dict, tmp_path: Path, capability: str) -> None:
    """In a main process with torch's threads (a notebook, num_workers=0), a busy machine's cores
    shared by them made a resize 5x slower than PIL's: no fast-path op may start one. Where
    torch has no SIMD kernel (ATEN_CPU_CAPABILITY=default: ARM, old x86), PIL resizes, exactly."""
    paths = []
    for i, data in enumerate(pictures["large"] + pictures["medium"] + pictures["odd"]):
        paths.append(tmp_path / f"{i}.jpg")
        paths[-1].write_bytes(data)
    env = (
        {**os.environ, "ATEN_CPU_CAPABILITY": capability}
        if capability
        else {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    )
    out = subprocess.run([sys.executable, "-c", _NO_THREADS, *map(str, paths)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    if capability == "default":
        assert out.stdout.split() == ["DEFAULT", "False", "True"]  # PIL's resize of libjpeg-turbo's pixels
    else:
        assert out.stdout.split()[1] == str(torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def test_dct_scaling_follows_pils_draft(fast_decodes: list) -> None:
    """1/2, 1/4 or 1/8 (never libjpeg-turbo's 3/8, 5/8...), as far as keeps each side at least
    `reducing_gap` times its resized size, by PIL's rule: source // k >= wanted."""
    for source, size, want in [
        ((1200, 900), 128, (600, 450)),
        ((1023, 767), 128, (512, 384)),
        ((4000, 3000), 64, (500, 375)),
        ((2001, 1503), 100, (501, 376)),
        ((511, 681), 128, (511, 681)),
    ]:  # 511 // 2 < 2 x 128 (ceil(511 / 2) is not)
        data = encode(Image.new("RGB", source, (90, 120, 30)))
        fast_decodes.clear()
        resized(data, size)
        assert fast_decodes == [(want[1], want[0], 3)], source
        pil = Image.open(io.BytesIO(data))
        pil.draft("RGB", tuple(2 * n for n in geometry(source, size)[0]))
        assert pil.size == want


def test_what_the_fast_path_leaves_to_pil(pictures: dict, fast_decodes: list, monkeypatch: pytest.MonkeyPatch) -> None:
    img = Image.open(io.BytesIO(pictures["medium"][1])).convert("RGB")
    whole = encode(img)
    sof = whole.index(b"\xff\xc0")  # baseline frame -> extended, 12-bit: libjpeg-turbo's 8-bit decoder refuses it
    twelve = whole[:sof] + b"\xff\xc1" + whole[sof + 2 : sof + 4] + b"\x0c" + whole[sof + 5 :]
    others = {
        "png": encode(img, "PNG"),
        "webp": encode(img, "WEBP"),
        "cmyk": encode(img.convert("CMYK")),
        "truncated": whole[: len(whole) // 2],
        "12-bit": twelve,
        "junk": b"\xff\xd8\xff" + bytes(200),
        "empty": b"",
    }
    for name, data in others.items():
        outcomes = []
        for backend in ("auto", "pil"):
            try:
                outcomes.append(np.asarray(resized(data, 64, 48, backend=backend)))
            except Exception as e:  # noqa: BLE001 - the very error PIL raises, compared below
                outcomes.append(f"{type(e).__name__}: {e}")
        assert str(outcomes[0]) == str(outcomes[1]), name
    assert isinstance(outcomes[0], str)
    assert jpeg.header(others["cmyk"]) is None and jpeg.header(whole) == img.size
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)  # a notebook's setting: PIL pads, so do we
    assert np.array_equal(
        np.asarray(resized(others["truncated"], 64)), np.asarray(resized(others["truncated"], 64, backend="pil"))
    )
    pixels = img.width * img.height
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", pixels - 1)  # a decompression bomb: PIL's warning, PIL's error
    with pytest.warns(Image.DecompressionBombWarning):
        resized(whole, 16)
    assert fast_decodes == []  # none of these: simplejpeg refused the truncated scan (strict), PIL had the rest
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", pixels // 3)
    with pytest.raises(FieldError, match="field 'jpg': DecompressionBombError: Image size"):
        decoder("rgb8")({"jpg": whole})


def test_bad_jpegs_are_named_and_skipped_as_with_pil(pictures: dict, tmp_path: Path) -> None:
    good = pictures["medium"][0]
    url = _tar_of(
        tmp_path / "x.tar",
        {
            "a.jpg": good,
            "a.cls": b"1",
            "b.jpg": good[: len(good) // 2],
            "b.cls": b"2",
            "c.jpg": b"\xff\xd8\xffjunk",
            "c.cls": b"3",
            "d.jpg": good,
            "d.cls": b"4",
        },
    )
    for options in ({"decode": "tensor"}, {"decode": "raw", "transform": image_transform(64, 48)}):
        errors, kept = [], []
        for backend in ("auto", "pil"):
            with pytest.raises(CorruptShardError) as err:
                list(StreamingDataset([url], backend=backend, **options))
            errors.append(str(err.value))
            ds = StreamingDataset([url], backend=backend, on_error="skip", **options)
            kept.append([len(list(ds)), ds.stats()["skipped"]])
        assert errors[0] == errors[1] and "sample b at byte" in errors[0], errors
        assert kept[0] == kept[1] == [4, 2]  # two replaced by repeats, counted


def test_backend_is_checked_and_reaches_the_workers(packed: Path, tmp_path: Path) -> None:
    for make in (
        lambda: StreamingDataset(str(packed), backend="cv2"),
        lambda: image_transform(backend="cv2"),
        lambda: resized(b"", 8, backend="cv2"),
        lambda: decoder("rgb8", "cv2"),
    ):
        with pytest.raises(ValueError, match="backend must be one of \\('auto', 'pil'\\), not 'cv2'"):
            make()
    loader = torch.utils.data.DataLoader(StreamingDataset(str(packed), decode="rgb8", backend="pil"), num_workers=1)
    fast = torch.utils.data.DataLoader(StreamingDataset(str(packed), decode="rgb8"), num_workers=1)
    for a, b in zip(loader, fast):
        assert torch.equal(a["jpg"], b["jpg"])  # same pixels, either way
    lmdb = tmp_path / "lmdb"
    import shardkit

    shardkit.pack(str(packed), str(lmdb), format="lmdb", progress=False)
    for backend in ("auto", "pil"):
        assert LMDBDataset(str(lmdb), decode="rgb8", backend=backend)[0]["jpg"].shape == (40, 48, 3)


def test_the_fast_path_loads_lazily_and_resizes_with_pil_without_torch(pictures: dict, tmp_path: Path) -> None:
    path = tmp_path / "a.jpg"
    path.write_bytes(pictures["large"][0])
    code = f"""if True:
        import sys
        import shardkit, shardkit.decode
        assert "simplejpeg" not in sys.modules and "torch" not in sys.modules
        sys.modules["torch"] = None  # torch not installed
        import numpy as np
        from shardkit.decode import resized
        data = open({str(path)!r}, "rb").read()
        assert np.array_equal(np.asarray(resized(data, 64)), np.asarray(resized(data, 64, backend="pil")))
        print(shardkit.decode.decoder("rgb8")({{"jpg": data}})["jpg"].shape)
        assert "simplejpeg" in sys.modules
    """
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "(1503, 2001, 3)"


def _old_reencode(data: bytes, resize: int, quality: int) -> bytes:
    """pack --resize as it was, all PIL: what the fast path must reproduce byte for byte."""
    img = Image.open(io.BytesIO(data))
    if img.format == "JPEG":
        img.draft("RGB", (resize, resize))
    img = ImageOps.exif_transpose(img).convert("RGB")
    if min(img.size) > resize:
        w, h = img.size
        scale = resize / min(w, h)
        img = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BICUBIC)
    return encode(img, quality=quality)


def test_pack_resize_decodes_jpegs_fast_to_the_same_bytes(pictures: dict, fast_decodes: list) -> None:
    img = Image.open(io.BytesIO(pictures["large"][0])).convert("RGB")
    rotated = dict(variants(img.resize((640, 480))))["EXIF orientation 6"]
    sources = [*pictures["large"], *pictures["odd"], encode(img.convert("L")), rotated, encode(img, "PNG")]
    for data in sources:
        assert images.reencode(data, 96, 90) == _old_reencode(data, 96, 90)
    # not the PNG; the rotated JPEG is PIL's to decode (after a check of its scans at 1/8, the one small shape)
    assert len(fast_decodes) == len(sources) - 1 and min(fast_decodes) == (60, 80, 3)
    assert Image.open(io.BytesIO(images.reencode(rotated, 96, 90))).size == (96, 128)  # turned upright
