"""Packing samples that are more than an image and a class: sidecar files beside the images
(`photo.txt`, `photo.json`, `photo.seg.png`, `--fields`), folders without classes
(`layout="flat"`) and manifests (`train.csv`, `train.jsonl`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import shardkit
from shardkit import StreamingDataset
from shardkit.errors import SourceError

from conftest import draw, webdataset_samples
from test_pack import read_shards, tree_bytes


def captioned(root: Path, per_class: int = 4) -> Path:
    """Class folders of images with a caption each, and boxes (json) and a mask for some."""
    for label, name in enumerate(("cat", "dog")):
        for i in range(per_class):
            stem = root / name / f"p{i:03d}"
            draw(
                stem.with_suffix(".png" if i == 1 else ".jpg"),
                label,
                seed=10 * label + i,
                fmt="PNG" if i == 1 else "JPEG",
            )
            stem.with_suffix(".txt").write_text(f"a {name} number {i}, ünïcödé")
            if i % 2 == 0:
                stem.with_suffix(".json").write_text(json.dumps({"boxes": [[i, i, 10, 10]], "label": name}))
            if i == 0:
                draw(root / name / f"p{i:03d}.seg.png", 0, seed=99, fmt="PNG")
    return root


def flat(root: Path, n: int = 8) -> Path:
    """Images anywhere under the folder, captioned, no class folders."""
    for i in range(n):
        stem = root / ("nested/deeper" if i % 3 == 0 else "") / f"img.{i:03d}"  # a dot in the stem
        draw(Path(f"{stem}.jpg"), i % 3, seed=i)
        Path(f"{stem}.txt").write_text(f"caption {i}")
    return root


def manifest(root: Path, kind: str, n: int = 8) -> Path:
    """train.csv or train.jsonl beside an images/ folder: path, label, caption, one more column."""
    rows = []
    for i in range(n):
        rel = f"images/{i:03d}.jpg"
        draw(root / rel, i % 2, seed=i)
        rows.append({"path": rel, "label": ("cat", "dog")[i % 2], "caption": f'photo {i}, "quoted"', "source": "web"})
    if kind == "csv":
        lines = ["path,label,caption,source"] + [
            f'{r["path"]},{r["label"]},"{r["caption"].replace(chr(34), 2 * chr(34))}",{r["source"]}' for r in rows
        ]
        (root / "train.csv").write_text("\n".join(lines) + "\n")
        return root / "train.csv"
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "train.jsonl"


SOURCES: dict[str, Callable[[Path], tuple[Path, dict]]] = {
    "sidecars": lambda root: (captioned(root / "src"), {}),
    "flat": lambda root: (flat(root / "src"), {"layout": "flat"}),
    "csv": lambda root: (manifest(root / "src", "csv"), {}),
    "jsonl": lambda root: (manifest(root / "src", "jsonl"), {}),
}


def by_path(dest: Path, meta: str = "json") -> dict[str, dict[str, bytes]]:
    return {json.loads(f[meta])["path"]: f for f in read_shards(dest).values()}


def test_sidecars_become_fields_of_their_images_sample(tmp_path: Path) -> None:
    src = captioned(tmp_path / "src")
    (src / "dog" / "orphan.txt").write_text("no image")
    (src / "dog" / "p001.cls").write_text("0")
    idx = shardkit.pack(str(src), str(tmp_path / "out"), max_count=3, workers=2, progress=False)
    assert idx.samples == 8 and idx.classes == ("cat", "dog")
    # the images' own json wins the `json` field; shardkit's record of class and path moves aside
    assert idx.fields == ("cls", "jpg", "json", "png", "seg.png", "shardkit.json", "txt")
    samples = by_path(tmp_path / "out", meta="shardkit.json")
    assert sorted(samples) == [f"{c}/p{i:03d}.{'png' if i == 1 else 'jpg'}" for c in ("cat", "dog") for i in range(4)]
    for path, fields in samples.items():
        stem = src / path.rsplit(".", 1)[0]
        meta = json.loads(fields["shardkit.json"])
        assert meta == {"class": path.split("/")[0], "path": path}
        assert fields["txt"] == stem.with_suffix(".txt").read_bytes()
        assert fields.get("json") == (stem.with_suffix(".json").read_bytes() if int(path[-5]) % 2 == 0 else None)
        assert ("seg.png" in fields) == path.endswith("p000.jpg")
    assert (
        {s.path: s.reason for s in idx.skipped}
        == {
            "dog/orphan.txt": "not an image file extension",  # as before sidecars: the pack of a folder with notes is unchanged
            "dog/p001.cls": "a class file beside an image in a class folder: the folder gives its class",
        }
    )
    # what webdataset reads from the shards is what they hold
    urls = [str(tmp_path / "out" / s.name) for s in idx.shards]
    assert {
        s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")} for s in webdataset_samples(urls)
    } == read_shards(tmp_path / "out")
    # and the reader decodes the caption to str, the json to its value, the mask as an image
    got = {s["shardkit.json"]["path"]: s for s in StreamingDataset(str(tmp_path / "out"), decode="rgb8")}
    first = got["cat/p000.jpg"]
    assert first["txt"] == "a cat number 0, ünïcödé" and first["json"]["boxes"] == [[0, 0, 10, 10]]
    assert first["seg.png"].shape == (40, 48, 3) and first["cls"] == 0


def test_without_a_json_sidecar_the_record_stays_in_json(tmp_path: Path) -> None:
    src = captioned(tmp_path / "src")
    for p in src.glob("*/*.json"):
        p.unlink()
    idx = shardkit.pack(str(src), str(tmp_path / "out"), workers=1, progress=False)
    assert idx.fields == ("cls", "jpg", "json", "png", "seg.png", "txt")
    assert all(set(json.loads(f["json"])) == {"class", "path"} for f in read_shards(tmp_path / "out").values())


def test_an_image_folder_without_sidecars_packs_as_before(photos: Path, tmp_path: Path) -> None:
    """The same shards and plan fingerprint as before sidecars existed (the code of e8976a7
    made these), so a pack made then is finished, or kept, by a rerun now."""
    import hashlib

    for path in photos.rglob("*"):
        os.utime(path, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    idx = shardkit.pack(str(photos), str(tmp_path / "out"), max_count=7, workers=1, progress=False)
    assert idx.fields == ("cls", "jpg", "json")
    shards = hashlib.sha256("".join(s.sha256 or "" for s in idx.shards).encode()).hexdigest()
    assert (idx.plan, shards) == (
        "83d3a25caafcd3ef539c3438fb863a8f05ae18bd6cb16f6a2da9da393321d6ae",
        "ca2a083fc618023e3d2bc92ce68ed4a3cb314019910f774f7dbe7936482094f5",
    )


def test_flat_layout_has_no_classes(tmp_path: Path) -> None:
    src = flat(tmp_path / "src")
    with pytest.raises(SourceError, match=r"no class folders .*--layout flat"):
        shardkit.pack(str(src / "nested" / "deeper"), str(tmp_path / "x"), workers=1, progress=False)
    idx = shardkit.pack(str(src), str(tmp_path / "out"), layout="flat", workers=1, progress=False)
    assert idx.samples == 8 and idx.classes == () and idx.fields == ("jpg", "json", "txt")
    samples = by_path(tmp_path / "out")
    assert sorted(samples)[:3] == ["img.001.jpg", "img.002.jpg", "img.004.jpg"]
    assert "nested/deeper/img.000.jpg" in samples
    for path, fields in samples.items():
        assert json.loads(fields["json"]) == {"path": path}
        assert fields["txt"] == (src / path).with_suffix(".txt").read_bytes()
    with pytest.raises(ValueError, match="layout must be 'classes' or 'flat', not 'flats'"):
        shardkit.pack(str(src), str(tmp_path / "y"), layout="flats", workers=1, progress=False)


def test_fields_names_more_sidecars(tmp_path: Path) -> None:
    src = tmp_path / "src"
    draw(src / "a" / "photo.jpg", 0, seed=1)
    draw(src / "a" / "photo.depth.png", 0, seed=2, fmt="PNG")
    (src / "a" / "photo.npy").write_bytes(b"\x93NUMPY")
    plain = shardkit.pack(str(src), str(tmp_path / "plain"), workers=1, progress=False)
    assert plain.samples == 2  # a .png is an image of its own, unless named a field
    assert [s.path for s in plain.skipped] == ["a/photo.npy"]
    idx = shardkit.pack(str(src), str(tmp_path / "out"), fields=("depth.png", "npy"), workers=1, progress=False)
    assert idx.samples == 1 and idx.skipped == () and idx.fields == ("cls", "depth.png", "jpg", "json", "npy")
    for bad in ("", ".txt", "a/b", "_x", "txt."):
        with pytest.raises(ValueError, match=f"fields: {bad!r} is not a field name"):
            shardkit.pack(str(src), str(tmp_path / "bad"), fields=(bad,), workers=1, progress=False)


def test_a_bad_sidecar_skips_its_sample_naming_the_file(tmp_path: Path) -> None:
    src = captioned(tmp_path / "src")
    (src / "cat" / "p000.json").write_text("{not json")
    (src / "dog" / "p003.txt").write_bytes(b"\xff\xfe caption")
    idx = shardkit.pack(str(src), str(tmp_path / "out"), workers=1, progress=False)
    assert idx.samples == 6
    assert {s.path: s.reason.split(" (")[0] for s in idx.skipped} == {
        "cat/p000.jpg": "cat/p000.json: not valid JSON",
        "dog/p003.jpg": "dog/p003.txt: not UTF-8 text",
    }
    with pytest.raises(SourceError, match=r"cat/p000.jpg: cat/p000.json: not valid JSON"):
        shardkit.pack(str(src), str(tmp_path / "fail"), workers=1, progress=False, on_error="raise")


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_a_manifest_lists_images_and_their_fields(tmp_path: Path, kind: str) -> None:
    path = manifest(tmp_path / "src", kind)
    idx = shardkit.pack(str(path), str(tmp_path / "out"), max_count=3, workers=2, progress=False)
    assert idx.samples == 8 and idx.classes == ("cat", "dog") and idx.skipped == ()
    assert idx.fields == ("cls", "jpg", "json", "source", "txt")
    for rel, fields in by_path(tmp_path / "out").items():
        i = int(rel[-7:-4])
        assert json.loads(fields["json"]) == {"class": ("cat", "dog")[i % 2], "path": rel}
        assert fields["jpg"] == (tmp_path / "src" / rel).read_bytes()
        assert fields["txt"] == f'photo {i}, "quoted"'.encode() and fields["source"] == b"web"
        assert int(fields["cls"]) == i % 2


def test_jsonl_values_and_integer_labels(tmp_path: Path) -> None:
    src = tmp_path / "src"
    draw(src / "a.jpg", 0, seed=1)
    draw(src / "b.jpg", 0, seed=2)
    rows = [
        {"file_name": "a.jpg", "label": 7, "text": "first", "json": {"boxes": [[1, 2, 3, 4]]}, "score": 0.5},
        {"file_name": "b.jpg", "label": 12, "text": "second", "json": {"boxes": []}, "score": None},
    ]
    (src / "meta.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    idx = shardkit.pack(str(src / "meta.jsonl"), str(tmp_path / "out"), shuffle=False, workers=1, progress=False)
    assert idx.classes == () and idx.fields == ("cls", "jpg", "json", "score", "shardkit.json", "txt")
    got = list(StreamingDataset(str(tmp_path / "out")))
    assert [(s["cls"], s["txt"], s["json"], s.get("score")) for s in got] == [
        (7, "first", {"boxes": [[1, 2, 3, 4]]}, b"0.5"),
        (12, "second", {"boxes": []}, None),
    ]  # null: no field
    assert got[0]["shardkit.json"] == {"path": "a.jpg"}


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_bad_rows_and_missing_files_are_named(tmp_path: Path, kind: str) -> None:
    path = manifest(tmp_path / "src", kind)
    os.remove(tmp_path / "src" / "images" / "002.jpg")
    bad = {
        "csv": [
            "../outside.jpg,cat,x,web",
            ",cat,no path,web",
            "images/001.jpg,cat",
            "images/003.jpg,,no label,web",
            "images/004.jpg,cat,a\0b,web",
        ],
        "jsonl": [
            '{"path": "../outside.jpg", "label": "cat"}',
            '{"label": "cat"}',
            "[1, 2]",
            "{broken",
            '{"path": "images/003.jpg", "label": null}',
            '{"path": "images/004.jpg", "json": "{broken"}',
        ],
    }[kind]
    with open(path, "a") as f:
        f.write("\n".join(bad) + "\n")
    idx = shardkit.pack(str(path), str(tmp_path / "out"), workers=1, progress=False)
    assert idx.samples == 7
    first = 2 if kind == "csv" else 1  # the line of the first row
    reasons = {s.path: s.reason for s in idx.skipped}
    assert reasons.pop("images/002.jpg") == f"no such file (train.{kind} line {first + 2})"
    why = ["path '../outside.jpg' is not inside the manifest's folder", "no path"]
    why += (
        ["2 values for 4 columns", "no label", "a NUL character in 'caption'"]
        if kind == "csv"
        else ["not a JSON object", "not valid JSON", "no label", "column 'json': not valid JSON"]
    )
    assert {k: v.split(" (")[0] for k, v in reasons.items()} == {
        f"train.{kind}:{first + 8 + n}": reason for n, reason in enumerate(why)
    }
    with pytest.raises(SourceError, match=rf"images/002.jpg: no such file \(train.{kind} line {first + 2}\)"):
        shardkit.pack(str(path), str(tmp_path / "fail"), workers=1, progress=False, on_error="raise")


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "label,caption\ncat,x\n",
            r"train.csv: no column for the image path \(path or file_name\); its columns: label, caption",
        ),
        ("path,caption,txt\na.jpg,x,y\n", r"train.csv: columns 'caption' and 'txt' both give field 'txt'"),
        ("", r"train.csv: empty"),
    ],
)
def test_a_manifest_that_cannot_be_read_says_why(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "train.csv").write_text(text)
    with pytest.raises(SourceError, match=message):
        shardkit.pack(str(tmp_path / "train.csv"), str(tmp_path / "out"), workers=1, progress=False)


# ------------------------------------------------ as image-folder packs: the same promises, each source


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_deterministic_whatever_the_workers(tmp_path: Path, source: str) -> None:
    src, opts = SOURCES[source](tmp_path)
    for name, workers, seed in (("a", 1, 0), ("b", 3, 0), ("c", 2, 1)):
        shardkit.pack(str(src), str(tmp_path / name), max_count=3, workers=workers, seed=seed, progress=False, **opts)
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b") != tree_bytes(tmp_path / "c")
    assert shardkit.verify(str(tmp_path / "a")) == []


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_rerun_reuses_shards_and_repairs_damage(tmp_path: Path, source: str) -> None:
    src, opts = SOURCES[source](tmp_path)
    out = tmp_path / "out"
    shardkit.pack(str(src), str(out), max_count=3, workers=2, progress=False, **opts)
    clean = tree_bytes(out)
    stats: dict[str, int] = {}
    shardkit.pack(str(src), str(out), max_count=3, workers=2, progress=False, stats=stats, **opts)
    assert stats == {"kept": 8, "written": 0, "unchanged": 1}
    (out / "index.json").unlink()
    (out / "shard-000001.tar").unlink()
    (out / ".shardkit-progress").mkdir()
    shardkit.pack(str(src), str(out), max_count=3, workers=2, progress=False, **opts)
    assert tree_bytes(out) == clean


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_an_edited_sidecar_or_row_makes_another_pack(tmp_path: Path, source: str) -> None:
    src, opts = SOURCES[source](tmp_path)
    out = tmp_path / "out"
    shardkit.pack(str(src), str(out), workers=1, progress=False, **opts)
    time.sleep(0.01)  # a new modification time, whatever the file system's resolution
    if source in ("csv", "jsonl"):
        src.write_text(src.read_text().replace("photo 3", "photo three"))
    else:
        edited = sorted(src.rglob("*.txt"))[2]
        edited.write_text(edited.read_text() + "!")
    with pytest.raises(SourceError, match="already holds a different dataset"):
        shardkit.pack(str(src), str(out), workers=1, progress=False, **opts)


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_kill_at_any_moment_then_rerun(tmp_path: Path, source: str) -> None:
    src, opts = SOURCES[source](tmp_path)
    if source == "sidecars":  # enough work for kills to land mid-run
        captioned(src, per_class=30)
    elif source == "flat":
        flat(src, n=60)
    else:
        manifest(tmp_path / "src", source, n=60)
    reference = tmp_path / "ref"
    shardkit.pack(str(src), str(reference), max_count=2, workers=1, progress=False, **opts)
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "shardkit.cli",
        "pack",
        str(src),
        str(out),
        "--max-count",
        "2",
        "--workers",
        "2",
        "-q",
        *(["--layout", "flat"] if opts else []),
    ]
    for target in (1, 12):
        proc = subprocess.Popen(cmd, start_new_session=True)
        while proc.poll() is None and len(list(out.glob("shard-*.tar"))) < target:
            time.sleep(0.001)
        with contextlib.suppress(ProcessLookupError):  # finished before it could be killed
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    subprocess.run(cmd, check=True)
    assert tree_bytes(out) == tree_bytes(reference)


def test_cli_packs_a_manifest_and_info_shows_the_fields(tmp_path: Path) -> None:
    path = manifest(tmp_path / "src", "csv")
    out = tmp_path / "out"
    cli = [sys.executable, "-m", "shardkit.cli"]
    subprocess.run([*cli, "pack", str(path), str(out), "-q"], check=True)
    info = subprocess.run([*cli, "info", str(out)], check=True, capture_output=True, text=True).stdout
    assert "fields cls, jpg, json, source, txt" in info
    flat(tmp_path / "flat")
    result = subprocess.run(
        [
            *cli,
            "pack",
            str(tmp_path / "flat"),
            str(tmp_path / "f"),
            "--layout",
            "flat",
            "--fields",
            "txt,depth.png",
            "-q",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "f" / "index.json").read_text())["fields"] == ["jpg", "json", "txt"]
    result = subprocess.run(
        [*cli, "pack", str(tmp_path / "flat"), str(tmp_path / "g"), "--fields", "a/b"], capture_output=True, text=True
    )
    assert result.returncode == 1 and "fields: 'a/b' is not a field name" in result.stderr


def test_preview_shows_captions(tmp_path: Path) -> None:
    from shardkit.tools.preview import grid_size, render_preview

    shardkit.pack(str(flat(tmp_path / "src")), str(tmp_path / "out"), layout="flat", workers=1, progress=False)
    doc = render_preview(str(tmp_path / "out"), n=4, out=str(tmp_path / "grid.png"))
    assert len(doc["captions"]) == 4 and all(caption.startswith("caption ") for caption in doc["captions"])
    assert doc["size"] == list(grid_size(4, captions=True)) and grid_size(4, captions=True)[1] > grid_size(4)[1]


def test_image_transform_pairs_the_image_with_its_caption(tmp_path: Path) -> None:
    from shardkit.decode import image_transform

    shardkit.pack(str(flat(tmp_path / "src")), str(tmp_path / "out"), layout="flat", workers=1, progress=False)
    ds = StreamingDataset(str(tmp_path / "out"), transform=image_transform(32, 24, label="txt"))
    image, caption = next(iter(ds))
    assert tuple(image.shape) == (3, 24, 24) and caption.startswith("caption ")


@pytest.mark.parametrize("source", ["sidecars", "flat", "csv"])
def test_from_a_bucket_as_from_the_disk(s3: dict, tmp_path: Path, source: str) -> None:
    import fsspec.core

    src, opts = SOURCES[source](tmp_path)
    (tmp_path / "src" / ("dog" if source == "sidecars" else "") / "orphan.txt").write_text("no image")
    local = shardkit.pack(str(src), str(tmp_path / "local"), max_count=3, workers=1, progress=False, **opts)
    fs, root = fsspec.core.url_to_fs(s3["url"], **s3["storage_options"])
    fs.put(str(tmp_path / "src"), f"{root}/src", recursive=True)
    url = s3["url"] + "/src" + ("/train.csv" if source == "csv" else "")
    remote = shardkit.pack(
        url, s3["url"] + "/out", max_count=3, workers=2, progress=False, storage_options=s3["storage_options"], **opts
    )
    assert [s.sha256 for s in remote.shards] == [s.sha256 for s in local.shards]  # the same bytes
    assert (remote.fields, remote.classes, remote.skipped) == (local.fields, local.classes, local.skipped)


def test_the_clip_snippet_of_the_layouts_page_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    from conftest import ROOT

    page = (ROOT / "docs" / "guides" / "layouts.md").read_text()
    code = re.search(r"<!-- layouts-clip -->\n```python\n(.*?)```", page, re.S)
    assert code, "docs/guides/layouts.md has no block tagged layouts-clip"
    shardkit.pack(
        str(flat(tmp_path / "photos", n=16)),
        str(tmp_path / "captions-shards"),
        layout="flat",
        workers=1,
        progress=False,
    )
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(code.group(1), scope)
    assert scope["loss"].item() > 0 and len(scope["captions"]) == 8 and scope["captions"][0].startswith("caption ")
