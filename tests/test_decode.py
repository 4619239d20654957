"""Decoding straight to the training size: `resized`, `resized_tensor`, `image_transform`."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from make_images import make_image_folder
from PIL import Image
from torch.utils.data import DataLoader

import shardkit
from shardkit import CorruptShardError, StreamingDataset
from shardkit.decode import ImageTransform, geometry, image_field, image_transform, resized, resized_tensor
from shardkit.errors import FieldError

CASES = [(256, 224), (160, 128), (96, None), ((200, 150), None), ((300, 240), (256, 192))]


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[bytes]]:
    """Real photo crops: 'large' (1100-1300 px, where libjpeg's DCT scaling applies) and
    'medium' (300-500 px, the generator's ImageNet-like default)."""
    root = tmp_path_factory.mktemp("decode")
    large = make_image_folder(root / "large", 3, 3, seed=1, min_side=1100, max_side=1300, workers=1)
    medium = make_image_folder(root / "medium", 3, 3, seed=2, workers=1)
    return {"large": [p.read_bytes() for p in large], "medium": [p.read_bytes() for p in medium]}


def two_step(data: bytes, size: int | tuple[int, int], crop: int | tuple[int, int] | None) -> Image.Image:
    """The reference: decode everything, resize the shorter side (torchvision's Resize),
    center-crop (torchvision's CenterCrop)."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = img.size
    if isinstance(size, int):
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = size, int(size * long / short)
        size = (new_short, new_long) if w <= h else (new_long, new_short)
    img = img.resize(size, Image.Resampling.BILINEAR)
    if crop is None:
        return img
    cw, ch = (crop, crop) if isinstance(crop, int) else crop
    left, top = int(round((img.width - cw) / 2.0)), int(round((img.height - ch) / 2.0))
    return img.crop((left, top, left + cw, top + ch))


def diff(a: Image.Image, b: Image.Image) -> np.ndarray:
    assert a.mode == b.mode == "RGB" and a.size == b.size
    return np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16))


@pytest.mark.parametrize("kind", ["large", "medium"])
@pytest.mark.parametrize(("size", "crop"), CASES)
def test_one_step_is_within_a_few_levels_of_two_steps(photos: dict, kind: str, size: int, crop: int | None) -> None:
    for data in photos[kind]:
        d = diff(resized(data, size, crop), two_step(data, size, crop))
        assert d.mean() < 1.0 and np.percentile(d, 99.9) <= 8 and d.max() <= 16, (d.mean(), d.max())


@pytest.mark.parametrize(("size", "crop"), CASES)
def test_without_reducing_gap_it_is_the_two_step_result(photos: dict, size: int, crop: int | None) -> None:
    # resampling only the crop's box samples the very same points: exact up to rounding
    for data in photos["large"] + photos["medium"]:
        assert diff(resized(data, size, crop, reducing_gap=None), two_step(data, size, crop)).max() <= 1


def test_large_jpegs_are_decoded_scaled_down(photos: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[tuple[int, int]] = []
    convert = Image.Image.convert

    def spy(self: Image.Image, *args: object, **kwargs: object) -> Image.Image:
        decoded.append(self.size)
        return convert(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Image.Image, "convert", spy)
    data = photos["large"][0]
    source = Image.open(io.BytesIO(data)).size
    grey = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("L").save(grey, "JPEG", quality=90)
    decoded.clear()
    img = resized(grey.getvalue(), 128, 112, backend="pil")  # a grey JPEG goes through convert("RGB")
    assert img.mode == "RGB" and img.size == (112, 112)
    # DCT scaling by 1/4 keeps at least 2 x 128 px of the shorter side (1100-1300 px)
    assert decoded == [((source[0] + 3) // 4, (source[1] + 3) // 4)]


def test_other_formats_and_modes(photos: dict) -> None:
    rgb = Image.open(io.BytesIO(photos["medium"][0])).convert("RGB")
    for mode, fmt in [("RGB", "PNG"), ("RGBA", "PNG"), ("L", "PNG"), ("P", "PNG"), ("RGB", "WEBP"), ("CMYK", "JPEG")]:
        buf = io.BytesIO()
        (rgb.convert(mode) if mode != "P" else rgb.quantize(64)).save(buf, fmt)
        out = resized(buf.getvalue(), 64, 48)
        assert out.mode == "RGB" and out.size == (48, 48), (mode, fmt)
    assert resized(rgb, 64).size == geometry(rgb.size, 64)[0]  # a decoded PIL image works too


def test_geometry_follows_torchvision() -> None:
    assert geometry((500, 375), 256) == ((341, 256), (341, 256), (0.0, 0.0, 500.0, 375.0))
    full, out, box = geometry((500, 375), 256, 224)
    assert full == (341, 256) and out == (224, 224)
    left, top = round((341 - 224) / 2), round((256 - 224) / 2)  # 58, 16
    assert box == pytest.approx((left * 500 / 341, top * 375 / 256, (left + 224) * 500 / 341, (top + 224) * 375 / 256))
    assert geometry((375, 500), 256)[0] == (256, 341)
    assert geometry((640, 480), (320, 200), (100, 50))[1] == (100, 50)


@pytest.mark.parametrize(
    ("size", "crop", "gap"),
    [
        (0, None, 2.0),
        (64, 65, 2.0),
        ((64, 32), (40, 40), 2.0),
        (64, 32, 0.5),
        (64, 32, float("nan")),
        (64, 32, float("inf")),
    ],
)
def test_bad_arguments(size: object, crop: object, gap: float) -> None:
    with pytest.raises(ValueError):
        resized(b"", size, crop, reducing_gap=gap)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        image_transform(size, crop, reducing_gap=gap)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", ["256", (32, 16, 8), 2.5, True])
def test_a_size_is_an_int_or_a_pair_of_ints(size: object) -> None:
    """'256' used to be read as the pair ('2', '5'): a 2x5 image."""
    with pytest.raises(TypeError, match="a size is an int .* or a \\(width, height\\) pair of ints"):
        image_transform(size, None)  # type: ignore[arg-type]


def test_resized_tensor(photos: dict) -> None:
    import torch

    data = photos["medium"][1]
    t = resized_tensor(data, 96, 80)
    assert t.dtype == torch.uint8 and t.shape == (3, 80, 80) and t.is_contiguous()
    assert np.array_equal(t.permute(1, 2, 0).numpy(), np.asarray(resized(data, 96, 80)))


def test_image_transform_on_a_raw_stream(packed: Path) -> None:
    transform = image_transform(size=32, crop=28)
    assert isinstance(transform, ImageTransform) and repr(transform) == "ImageTransform(size=32, crop=28)"
    copy = pickle.loads(pickle.dumps(transform))  # what a spawned DataLoader worker receives
    ds = StreamingDataset(str(packed), decode="raw", transform=copy)
    images, labels = next(iter(DataLoader(ds, batch_size=120)))
    assert images.shape == (120, 3, 28, 28) and labels.tolist().count(0) == 40
    raw = next(iter(StreamingDataset(str(packed), decode="raw")))
    image, label = transform(raw)
    assert label == raw["cls"] and np.array_equal(image.numpy(), images[0].numpy())
    pil = next(iter(StreamingDataset(str(packed), decode="pil")))  # decoded samples work too (by PIL's resize)
    assert np.abs(transform(pil)[0].numpy().astype(int) - images[0].numpy()).max() <= 1
    with pytest.raises(FieldError, match="no image field"):  # bad data: the reader names it, or skips it
        transform({"__key__": "x", "cls": 1})
    with pytest.raises(FieldError, match="has no field 'cls' for the label"):
        transform({"__key__": "x", "jpg": raw["jpg"]})
    tensor = next(iter(StreamingDataset(str(packed), decode="tensor")))  # decoded already: said so
    with pytest.raises(TypeError, match="takes samples read with decode='raw' .*, not a torch.Tensor"):
        transform(tensor)


def test_16_bit_grayscale_keeps_its_contrast(tmp_path: Path) -> None:
    """A depth map or scan decodes to its high byte in every decoder, `resized` and a pack
    with `--resize`; PIL's `convert("RGB")` alone makes 99% of this ramp white."""
    ramp = (np.arange(40 * 60).reshape(40, 60) * 27).astype(np.uint16)
    high = (ramp >> 8).astype(np.uint8)
    src = tmp_path / "src" / "depth"
    src.mkdir(parents=True)
    for fmt in ("PNG", "TIFF"):
        Image.fromarray(ramp).save(src / f"ramp.{fmt.lower()}", fmt)
        with Image.open(src / f"ramp.{fmt.lower()}") as img:
            assert img.mode == "I;16"
    Image.fromarray((ramp >> 8).astype(np.int32)).save(src / "labels.tiff", "TIFF")  # mode "I": as PIL converts it
    shardkit.pack(str(src.parent), str(tmp_path / "out"), workers=1, progress=False, shuffle=False)
    for mode, as_array in (
        ("rgb8", np.asarray),
        ("pil", np.asarray),
        ("tensor", lambda t: t.numpy().transpose(1, 2, 0)),
    ):
        samples = list(StreamingDataset(str(tmp_path / "out"), decode=mode))
        assert len(samples) == 3
        for sample in samples:
            image = as_array(sample.get("png", sample.get("tiff")))
            assert image.shape == (40, 60, 3) and all((image[..., c] == high).all() for c in range(3)), mode
    data = (src / "ramp.png").read_bytes()
    expected = Image.fromarray(high).convert("RGB").resize((30, 20), Image.Resampling.BILINEAR)
    assert diff(resized(data, 20, reducing_gap=None), expected).max() == 0
    shardkit.pack(str(src.parent), str(tmp_path / "small"), resize=20, workers=1, progress=False, shuffle=False)
    for sample in StreamingDataset(str(tmp_path / "small"), decode="rgb8"):
        assert sample["jpg"].shape == (20, 30, 3) and abs(sample["jpg"].mean() - high.mean()) < 2


def test_pil_images_come_decoded_so_a_bad_one_is_the_samples_error(tmp_path: Path) -> None:
    """Not an image PIL decodes later, in the caller's hands (a DataLoader worker failing to
    pickle it drops the batch): a JPEG cut in half is skipped like any bad sample."""
    buf = io.BytesIO()
    noise = np.random.default_rng(0).integers(0, 56, (48, 64, 3), dtype=np.uint8)
    Image.fromarray(noise + np.array([200, 0, 0], dtype=np.uint8)).save(buf, "JPEG")
    whole = buf.getvalue()  # mostly scan data: its first half opens, and fails as it decodes
    url = _tar_of(tmp_path / "x.tar", {"a.jpg": whole, "b.jpg": whole[: len(whole) // 2], "c.jpg": whole})
    ds = StreamingDataset([url], decode="pil", on_error="skip")
    samples = list(ds)
    assert len(samples) == 3 and ds.stats()["skipped"] == 1
    assert all(s["jpg"].getpixel((0, 0))[0] > 150 for s in samples)


def test_module_import_stays_light() -> None:
    code = "import sys, shardkit.decode; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": [1, 2.5, "x"], "b": null}',
        b'{"nan": NaN, "inf": -Infinity}',
        b'{"big": 123456789012345678901234567890}',
        b"[-9223372036854775809, 1e400]",
        b'["\\ud800", 1.5e300]',
        '{"é": "ü"}'.encode(),
    ],
)
def test_json_fields_decode_as_json_does(raw: bytes) -> None:
    import json

    from shardkit.decode import decoder

    got = decoder("raw")({"json": raw})["json"]
    want = json.loads(raw.decode())
    assert repr(got) == repr(want)  # types too: an int stays an int


def test_json_with_a_bom_or_in_utf16_decodes_as_webdataset_reads_it() -> None:
    from shardkit.decode import decoder

    for raw in (b'\xef\xbb\xbf{"a": 1}', '{"a": 1}'.encode("utf-16")):
        assert decoder("raw")({"json": raw})["json"] == {"a": 1}


def test_a_member_without_an_extension_leaves_its_sample_readable() -> None:
    from shardkit.decode import decoder, image_field

    sample = decoder("raw")({"__key__": "001", "": b"no extension", "cls": b"3"})
    assert sample == {"__key__": "001", "": b"no extension", "cls": 3} and image_field(sample) is None


def test_running_out_of_memory_is_not_bad_data(monkeypatch: pytest.MonkeyPatch, packed: Path) -> None:
    from shardkit import decode
    from shardkit.decode import fields

    def no_memory(data: bytes) -> None:
        raise MemoryError

    monkeypatch.setitem(fields._IMAGE, "pil", no_memory)
    with pytest.raises(MemoryError):
        decode.decoder("pil")({"jpg": b"..."})
    with pytest.raises(MemoryError):  # not skipped as a bad sample
        next(iter(StreamingDataset(str(packed), decode="pil", on_error="skip")))


@pytest.mark.parametrize("raw", [b'{"a": ', b"\xff\xfe{}"])
def test_bad_json_fields_raise_json_errors(raw: bytes) -> None:
    from shardkit.decode import decoder

    with pytest.raises(ValueError):
        decoder("raw")({"json": raw})


def test_upper_case_extensions_and_tiny_images_decode(tmp_path: Path) -> None:
    """`.JPG` from a camera is the field `jpg`, an image (WebDataset lower-cases extensions);
    a 1x1 image becomes a writable tensor with no warning."""
    import tarfile
    import warnings

    blobs = {}
    for name, size in (("UP.JPG", (1, 1)), ("y.seg.PNG", (5, 3))):
        buf = io.BytesIO()
        Image.new("RGB", size, (200, 10, 10)).save(buf, "PNG" if name.endswith("PNG") else "JPEG")
        blobs[name] = buf.getvalue()
    with tarfile.open(tmp_path / "x.tar", "w") as t:
        for name, data in blobs.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = list(StreamingDataset([str(tmp_path / "x.tar")], decode="tensor"))
    assert [tuple(s[k].shape) for s, k in zip(got, ("jpg", "seg.png"))] == [(3, 1, 1), (3, 3, 5)]
    got[0]["jpg"][0, 0, 0] = 1  # writable
    raw = list(StreamingDataset([str(tmp_path / "x.tar")]))
    assert [sorted(s) for s in raw] == [["__key__", "__url__", "jpg"], ["__key__", "__url__", "seg.png"]]


def test_two_members_that_are_one_field_in_lower_case_are_bad_data(tmp_path: Path) -> None:
    url = _tar_of(tmp_path / "x.tar", {"a.jpg": b"1", "a.JPG": b"2", "b.cls": b"3"})
    with pytest.raises(
        CorruptShardError,
        match=r"x\.tar: a sample at byte 0: members \['JPG', 'jpg'\] name the same "
        r"field once in lower case",
    ):
        list(StreamingDataset([url]))
    ds = StreamingDataset([url], on_error="skip")
    assert [s["cls"] for s in ds] == [3, 3] and ds.stats()["skipped"] == 1  # replaced, counted


def _tar_of(path: Path, members: dict[str, bytes]) -> str:
    import tarfile

    with tarfile.open(path, "w") as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return str(path)


def test_fields_follow_webdatasets_handlers(tmp_path: Path) -> None:
    """ints, json and text as webdataset's default decoders give them; anything else, `label`,
    `idx` and `class` included, stays bytes (a text label once made every sample unreadable)."""
    shard = _tar_of(
        tmp_path / "x.tar",
        {
            "s.cls": b"3",
            "s.inx": b"4\n",
            "s.id": b"7",
            "s.jsn": b'{"a": 1}',
            "s.text": "é".encode(),
            "s.label": b"dog\n",
            "s.idx": b"abc",
            "s.class": b"dog",
        },
    )
    (got,) = StreamingDataset([shard])
    assert {k: v for k, v in got.items() if not k.startswith("__")} == {
        "cls": 3,
        "inx": 4,
        "id": 7,
        "jsn": {"a": 1},
        "text": "é",
        "label": b"dog\n",
        "idx": b"abc",
        "class": b"dog",
    }


def test_a_field_that_does_not_decode_is_named(tmp_path: Path) -> None:
    shard = _tar_of(tmp_path / "y.tar", {"s.cls": b"dog", "s.jpg": b"\xff\xd8"})
    with pytest.raises(CorruptShardError) as err:
        list(StreamingDataset([shard]))
    text = str(err.value)
    assert "y.tar" in text and "sample s at byte 0" in text and "field 'cls': ValueError: invalid literal" in text
    assert "\n" not in text
    with pytest.raises(CorruptShardError, match=r"field 'jpg': UnidentifiedImageError"):
        list(StreamingDataset([_tar_of(tmp_path / "z.tar", {"s.jpg": b"\xff\xd8"})], decode="pil"))


def test_the_first_dataloader_collates_a_folder_of_jpg_png_and_webp(tmp_path: Path) -> None:
    """`DataLoader(StreamingDataset(src, decode=...), batch_size=4)` over mixed formats packed by
    `shardkit pack`: the image is under "image" whatever its extension (kept in "__ext__"), stacked
    once; `s["png"]` still reads it, and a raw sample keeps its fields as they were."""
    from click.testing import CliRunner

    from shardkit.cli import main

    formats = ("JPEG", "PNG", "WEBP")
    for label, name in enumerate(("cat", "dog")):
        for i in range(6):
            path = tmp_path / "src" / name / f"{i}.{formats[i % 3].lower().replace('jpeg', 'jpg')}"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGBA" if i % 3 == 1 else "RGB", (20, 16), (40 * i, 100 * label, 9)).save(path, formats[i % 3])
    result = CliRunner().invoke(main, ["pack", str(tmp_path / "src"), str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, result.output
    src = str(tmp_path / "out")
    for mode, shape in (("tensor", (4, 3, 16, 20)), ("rgb8", (4, 16, 20, 3))):
        batches = list(DataLoader(StreamingDataset(src, decode=mode), batch_size=4))
        assert [tuple(b["image"].shape) for b in batches] == [shape] * 3 and sum(len(b["cls"]) for b in batches) == 12
        assert sorted(e for b in batches for e in b["__ext__"]) == ["jpg"] * 4 + ["png"] * 4 + ["webp"] * 4
        assert "jpg" not in batches[0] and "png" not in batches[0]  # the image is stacked once
    in_workers = list(DataLoader(StreamingDataset(src, decode="tensor", batch_size=4), batch_size=None, num_workers=1))
    assert [tuple(b["image"].shape) for b in in_workers] == [(4, 3, 16, 20)] * 3
    pil = list(StreamingDataset(src, decode="pil"))
    assert all(isinstance(s["image"], Image.Image) and s[s["__ext__"]] is s["image"] for s in pil)
    assert [s.get("png") is s["image"] for s in pil] == [s["__ext__"] == "png" for s in pil]
    raw = next(iter(StreamingDataset(src)))
    assert "image" not in raw and "__ext__" not in raw and isinstance(raw[image_field(raw) or ""], bytes)
