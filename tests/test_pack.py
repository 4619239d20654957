"""The packer: round trip, WebDataset compatibility, determinism, crash safety, bad input."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import re
import signal
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

import shardkit
from shardkit.packing import executors
from shardkit.errors import ShardkitError, SourceError
from shardkit.formats.tar import iter_samples

from conftest import draw, kill_group, make_folder, shard_offsets, webdataset_samples


def read_shards(dest: Path) -> dict[str, dict[str, bytes]]:
    idx = json.loads((dest / "index.json").read_text())
    out = {}
    for s in idx["shards"]:
        with open(dest / s["name"], "rb") as f:
            for key, fields in iter_samples(f, s["name"]):
                assert key not in out
                out[key] = fields
    return out


def tree_bytes(dest: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(dest.iterdir()) if p.is_file()}


def test_round_trip_every_sample(photos: Path, tmp_path: Path) -> None:
    idx = shardkit.pack(str(photos), str(tmp_path / "out"), max_count=4, workers=2, progress=False)
    samples = read_shards(tmp_path / "out")
    assert idx.samples == len(samples) == 30
    assert idx.classes == ("circle", "square", "triangle")
    assert idx.fields == ("cls", "jpg", "json")
    for key, fields in samples.items():
        assert "." not in key
        meta = json.loads(fields["json"])
        assert fields["jpg"] == (photos / meta["path"]).read_bytes()
        assert int(fields["cls"]) == idx.classes.index(meta["class"])
        assert meta["path"].split("/")[0] == meta["class"]
    counts = [s.samples for s in idx.shards]
    assert len(counts) == 8 and max(counts) <= 4 and max(counts) - min(counts) <= 1  # even: no runt shard


def test_index_records_counts_offsets_and_checksums(photos: Path, tmp_path: Path) -> None:
    import hashlib

    shardkit.pack(str(photos), str(tmp_path / "out"), max_count=8, workers=1, progress=False)
    doc = json.loads((tmp_path / "out" / "index.json").read_text())
    assert doc["format"] == "shardkit" and doc["version"] == 2 and doc["samples"] == 30
    side = tmp_path / "out" / doc["offsets"]["file"]
    assert doc["offsets"]["sha256"] == hashlib.sha256(side.read_bytes()).hexdigest()
    table = np.load(side)  # a plain .npy: every shard's offsets back to back
    assert table.dtype == np.dtype("<i8") and len(table) == 30 + len(doc["shards"])
    at = 0
    for s in doc["shards"]:
        assert set(s) == {"name", "samples", "bytes", "sha256", "version"}  # per shard only: no per-sample list
        assert set(s["version"]) == {"fingerprint"}  # a local shard's pin (storage/fingerprint.py)
        data = (tmp_path / "out" / s["name"]).read_bytes()
        assert s["bytes"] == len(data)
        assert s["sha256"] == hashlib.sha256(data).hexdigest()
        offsets = table[at : at + s["samples"] + 1].tolist()
        at += s["samples"] + 1
        assert offsets == shard_offsets(tmp_path / "out")[s["name"]]
        for a, b in zip(offsets, offsets[1:]):
            assert len(list(iter_samples(io.BytesIO(data[a:b]), s["name"]))) == 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [*(s["name"] for s in doc["shards"]), "index.json", side.name]
    )


def test_webdataset_and_tar_read_the_output(photos: Path, tmp_path: Path) -> None:
    idx = shardkit.pack(str(photos), str(tmp_path / "out"), max_count=7, workers=2, progress=False)
    ours = read_shards(tmp_path / "out")
    urls = [str(tmp_path / "out" / s.name) for s in idx.shards]
    seen = {}
    for sample in webdataset_samples(urls):
        seen[sample["__key__"]] = {k: v for k, v in sample.items() if not k.startswith("__")}
    assert seen == ours
    listing = subprocess.run(["tar", "tvf", urls[0]], capture_output=True, text=True, check=True).stdout.split("\n")
    names = [line.split()[-1] for line in listing if line]
    assert names[:3] == [f"{names[0].split('.')[0]}.{ext}" for ext in ("cls", "jpg", "json")]
    assert all("0/0" in line and "1970-01-01" in line for line in listing if line)


def test_odd_file_names(tmp_path: Path) -> None:
    src = tmp_path / "src"
    names = ["a.b.c.jpg", "with space.JPEG", "ünïcödé 画像.jpeg", "UPPER.JPG", "x.png", "deep/er/nested.Jpg"]
    for i, name in enumerate(names):
        draw(src / "cls" / name, 0, seed=i, fmt="PNG" if name.endswith("png") else "JPEG")
    idx = shardkit.pack(str(src), str(tmp_path / "out"), workers=1, progress=False)
    samples = read_shards(tmp_path / "out")
    assert idx.samples == len(names) and not idx.skipped
    by_path = {json.loads(f["json"])["path"]: f for f in samples.values()}
    for name in names:
        fields = by_path[f"cls/{name}"]
        ext = "png" if name.endswith("png") else "jpg"
        assert fields[ext] == (src / "cls" / name).read_bytes()


@pytest.mark.parametrize("escaped", [False, True])
def test_planned_sizes_are_exact(tmp_path: Path, escaped: bool) -> None:
    """Shards are cut from sizes computed before any byte is read: they must be exact."""
    from shardkit.packing.plan import _needs, make_plan

    src = tmp_path / "src"
    names = ["a.jpg", "ünïcödé 画像.jpeg", "deep/er/x.png"] + (
        ['quo"te.jpg', "back\\slash.jpg", "tab\there.jpg"] if escaped else []
    )
    for i, name in enumerate(names):
        draw(src / ("class ü" if i % 2 else "b") / name, 0, seed=i, fmt="PNG" if name.endswith("png") else "JPEG")
    plan = make_plan(str(src), str(tmp_path / "out"), max_size=None, shuffle=False)
    idx = shardkit.pack(str(src), str(tmp_path / "out"), max_size=None, shuffle=False, workers=1, progress=False)
    offsets = shard_offsets(tmp_path / "out")[idx.shards[0].name]
    assert list(_needs(plan.listing, "folder", plan.classes)[plan.order]) == [
        b - a for a, b in zip(offsets, offsets[1:])
    ]


def test_deterministic_whatever_the_workers(photos: Path, tmp_path: Path) -> None:
    shardkit.pack(str(photos), str(tmp_path / "a"), max_count=4, workers=1, progress=False)
    shardkit.pack(str(photos), str(tmp_path / "b"), max_count=4, workers=3, progress=False)
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")
    shardkit.pack(str(photos), str(tmp_path / "c"), max_count=4, workers=2, seed=1, progress=False)
    assert tree_bytes(tmp_path / "a") != tree_bytes(tmp_path / "c")


def test_shuffle_off_keeps_class_order(photos: Path, tmp_path: Path) -> None:
    shardkit.pack(str(photos), str(tmp_path / "out"), shuffle=False, workers=1, progress=False)
    samples = read_shards(tmp_path / "out")
    labels = [int(samples[k]["cls"]) for k in sorted(samples)]
    assert labels == sorted(labels)


def test_max_size_bounds_shards(photos: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_size must be at least 10240 bytes .* not 8000"):
        shardkit.pack(str(photos), str(tmp_path / "out"), max_size="8KB", workers=1, progress=False)
    idx = shardkit.pack(str(photos), str(tmp_path / "out"), max_size="40KB", workers=1, progress=False)
    assert len(idx.shards) > 3
    for s in idx.shards:  # the whole file, end-of-archive blocks and record padding included
        assert s.bytes == (tmp_path / "out" / s.name).stat().st_size
        assert s.bytes <= 40_000 or s.samples == 1


def test_resize_and_quality(tmp_path: Path) -> None:
    from PIL import Image

    src = tmp_path / "src"
    draw(src / "a" / "big.png", 0, seed=1, size=(300, 200), fmt="PNG")
    draw(src / "a" / "small.jpg", 0, seed=2, size=(50, 40))
    shardkit.pack(str(src), str(tmp_path / "out"), resize=100, quality=80, workers=1, progress=False)
    samples = read_shards(tmp_path / "out")
    sizes = sorted(Image.open(io.BytesIO(f["jpg"])).size for f in samples.values())
    assert sizes == [(50, 40), (150, 100)]
    assert all(set(f) == {"cls", "jpg", "json"} for f in samples.values())


def test_bad_files_are_skipped_and_listed(photos: Path, tmp_path: Path) -> None:
    good = (photos / "circle" / "img_0000.jpg").read_bytes()
    (photos / "circle" / "empty.jpg").write_bytes(b"")
    (photos / "circle" / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (photos / "square" / "text.jpg").write_text("not an image")
    (photos / "square" / "notes.txt").write_text("hello")
    (photos / "square" / "dangling.jpg").symlink_to(tmp_path / "nowhere.jpg")
    (photos / "stray.jpg").write_bytes(good)
    draw(photos / "triangle" / "really_a_png.jpg", 2, seed=7, fmt="PNG")
    idx = shardkit.pack(str(photos), str(tmp_path / "out"), workers=2, progress=False)
    reasons = {s.path: s.reason for s in idx.skipped}
    assert reasons == {
        "circle/empty.jpg": "empty file",
        "circle/truncated.jpg": "truncated image",
        "square/text.jpg": "not an image file",
        "square/notes.txt": "not an image file extension",
        "square/dangling.jpg": "broken symlink",
        "stray.jpg": "not inside a class folder",
    }
    samples = read_shards(tmp_path / "out")
    assert idx.samples == len(samples) == 31
    png = [f for f in samples.values() if json.loads(f["json"])["path"] == "triangle/really_a_png.jpg"]
    assert set(png[0]) == {"cls", "png", "json"}  # stored under its real format
    info = json.loads((tmp_path / "out" / "index.json").read_text())
    assert len(info["skipped"]) == 6


def test_on_error_raise_names_the_file(photos: Path, tmp_path: Path) -> None:
    (photos / "square" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0garbage")
    with pytest.raises(SourceError, match=r"square/broken\.jpg: "):
        shardkit.pack(str(photos), str(tmp_path / "out"), on_error="raise", workers=2, max_count=3, progress=False)
    assert not (tmp_path / "out" / "index.json").exists()
    assert not [p for p in (tmp_path / "out").iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_on_error_is_no_part_of_what_a_pack_is(
    photos: Path, tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rerun under the other --on-error keeps the work (it would write the same bytes),
    unless that work left a file out and the rerun says fail: then it fails, naming it."""
    out = tmp_path / "out"
    shardkit.pack(str(photos), str(out), format=fmt, workers=1, max_count=7, progress=False)
    again = shardkit.pack(str(photos), str(out), format=fmt, workers=1, max_count=7, on_error="raise", progress=False)
    assert again.samples == 30

    (photos / "square" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0garbage")
    shutil.rmtree(out)
    shardkit.pack(str(photos), str(out), format=fmt, workers=1, max_count=7, progress=False)  # under skip
    message = r"square/broken\.jpg: .*\(left out by an earlier run of this pack under --on-error skip\)"
    with pytest.raises(SourceError, match=message):  # the finished pack
        shardkit.pack(str(photos), str(out), format=fmt, workers=1, max_count=7, on_error="raise", progress=False)
    if fmt == "tar":  # and one that a crash stopped before its index: its shards are kept work
        shutil.rmtree(out)

        def crash(*args: object, **kwargs: object) -> None:
            raise RuntimeError("killed before the index")

        with monkeypatch.context() as m:
            m.setattr(sys.modules["shardkit.index"], "save", crash)
            with pytest.raises(RuntimeError, match="killed before the index"):
                shardkit.pack(str(photos), str(out), workers=1, max_count=7, progress=False)
        with pytest.raises(SourceError, match=message):
            shardkit.pack(str(photos), str(out), workers=1, max_count=7, on_error="raise", progress=False)
        assert shardkit.pack(str(photos), str(out), workers=1, max_count=7, progress=False).samples == 30


def test_on_error_raise_passes_over_hidden_entries(photos: Path, tmp_path: Path) -> None:
    """.DS_Store and friends are not input: listed as ignored, never a failure."""
    (photos / "square" / ".DS_Store").write_bytes(b"\x00\x01")
    idx = shardkit.pack(str(photos), str(tmp_path / "out"), on_error="raise", workers=1, progress=False)
    assert idx.samples == 30 and [(s.path, s.reason) for s in idx.skipped] == [
        ("square/.DS_Store", "hidden entry ignored")
    ]


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: None, "no such folder"),
        (lambda p: p.write_text("x"), "not a folder"),
        (lambda p: p.mkdir(), "no class folders"),
        (lambda p: (p / "a").mkdir(parents=True), "no image files"),
    ],
)
def test_unusable_source(tmp_path: Path, setup, message: str) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "src"
    setup(src)
    with pytest.raises(SourceError, match=message):
        shardkit.pack(str(src), str(tmp_path / "out"), progress=False)


def test_decode_check_finds_what_the_cheap_checks_miss(photos: Path, tmp_path: Path) -> None:
    """A PNG whose compressed pixels are damaged has its magic bytes and end chunk: packed as
    good by default (a reader's decoder then refuses it), skipped with `decode_check`, from an
    image folder and in a conversion alike."""
    rng = np.random.default_rng(0)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(out, "PNG")
    data = bytearray(out.getvalue())
    data[data.index(b"IDAT") + 200] ^= 0xFF
    (photos / "circle" / "damaged.png").write_bytes(bytes(data))
    plain = shardkit.pack(str(photos), str(tmp_path / "plain"), workers=1, progress=False)
    assert plain.samples == 31 and plain.skipped == ()
    with pytest.raises(shardkit.CorruptShardError, match="field 'png'"):
        list(shardkit.StreamingDataset(str(tmp_path / "plain"), decode="rgb8"))
    for src, dest in ((photos, "checked"), (tmp_path / "plain", "converted")):
        idx = shardkit.pack(str(src), str(tmp_path / dest), workers=2, progress=False, decode_check=True)
        assert idx.samples == 30 and [s.reason.split(" (")[0] for s in idx.skipped] == ["cannot decode image"]
    with pytest.raises(SourceError, match=r"damaged\.png: cannot decode image"):
        shardkit.pack(
            str(photos), str(tmp_path / "fail"), workers=1, progress=False, decode_check=True, on_error="raise"
        )


def test_symlink_loops_do_not_hang(photos: Path, tmp_path: Path) -> None:
    (photos / "circle" / "loop").symlink_to(photos / "circle")
    (photos / "square" / "up").symlink_to(photos)
    (photos / "zloop").symlink_to(photos)  # a class folder that is SRC itself: not the whole tree again
    idx = shardkit.pack(str(photos), str(tmp_path / "out"), workers=1, progress=False)
    assert idx.samples == 30 and idx.classes[-1] == "zloop"
    assert {s.path for s in idx.skipped if "symlink loop" in s.reason} >= {"circle/loop/", "square/up/", "zloop/"}


def test_a_folder_reached_twice_is_no_loop(tmp_path: Path) -> None:
    """A symlink to a sibling class folder is read under both routes (as ImageFolder
    does); only a folder inside itself is a loop."""
    src = make_folder(tmp_path / "src", per_class=2, classes=("a", "b"))
    (src / "a" / "more").symlink_to(src / "b", target_is_directory=True)
    idx = shardkit.pack(str(src), str(tmp_path / "out"), workers=1, progress=False)
    paths = sorted(json.loads(f["json"])["path"] for f in read_shards(tmp_path / "out").values())
    assert paths == [
        "a/img_0000.jpg",
        "a/img_0001.jpg",
        "a/more/img_0000.jpg",
        "a/more/img_0001.jpg",
        "b/img_0000.jpg",
        "b/img_0001.jpg",
    ]
    assert idx.skipped == ()


def test_a_file_gone_since_the_scan_is_skipped_but_the_machine_failing_stops_the_pack(photos: Path) -> None:
    """A file deleted between scan and read is that file's problem: skipped and listed.
    Running out of file descriptors (a real EMFILE: the child fills its table) would fail
    every read after it: the pack raises, naming the file, instead of packing nothing."""
    script = f"""
import errno, os, sys
from shardkit.packing.jobs import job_samples
from shardkit.packing.plan import make_plan
from shardkit.index import Skipped
plan = make_plan({str(photos)!r}, "unused", max_count=4, shuffle=False)
job = plan.job(0)
os.unlink(os.path.join({str(photos)!r}, job.items[1].path))
got = list(job_samples(job))
assert [isinstance(g, Skipped) for g in got] == [False, True] + [False] * (len(got) - 2), got
print(got[1].reason)
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError as e:
    assert e.errno == errno.EMFILE
try:
    list(job_samples(job))
except OSError as e:
    print(errno.errorcode[e.errno], os.path.basename(e.filename))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "cannot read (No such file or directory)"
    assert out[1] == "EMFILE img_0000.jpg"


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"resize": -10}, ValueError, "resize must be at least 1, not -10"),  # made every image 1x1
        ({"resize": 0}, ValueError, "resize must be at least 1, not 0"),  # was ignored
        ({"quality": 101}, ValueError, "quality must be from 1 to 100, not 101"),
        ({"quality": 50.5}, TypeError, "quality must be an integer, not 50.5"),
        ({"workers": 0}, ValueError, "workers must be at least 1, not 0"),
        ({"max_count": 2.5}, TypeError, "max_count must be an integer, not 2.5"),
        ({"max_size": "abc"}, ValueError, "max_size: not a size: 'abc'"),
        ({"seed": 1.5}, TypeError, "seed must be an integer, not 1.5"),
        ({"format": "LMDB"}, ValueError, "format must be 'tar' or 'lmdb', not 'LMDB'"),
        ({"stats": []}, TypeError, "stats must be a dict to fill"),
    ],
)
def test_pack_arguments_fail_at_once_naming_them(
    photos: Path, tmp_path: Path, options: dict, error: type, message: str
) -> None:
    """The CLI's ranges, checked by the Python API as well, before anything is written."""
    with pytest.raises(error, match=re.escape(message)):
        shardkit.pack(str(photos), str(tmp_path / "out"), progress=False, **options)
    assert not (tmp_path / "out").exists()


def test_a_file_pil_cannot_read_is_skipped_when_re_encoding(photos: Path, tmp_path: Path) -> None:
    """PIL's OSError for a cut-off image carries no errno: bad data, not the machine failing."""
    whole = (photos / "circle" / "img_0000.jpg").read_bytes()
    (photos / "circle" / "img_0000.jpg").write_bytes(whole[:300])
    idx = shardkit.pack(str(photos), str(tmp_path / "out"), resize=32, workers=1, progress=False)
    assert idx.samples == 29 and [s.path for s in idx.skipped] == ["circle/img_0000.jpg"]


def test_a_job_given_up_ends_the_retries_of_its_threads() -> None:
    """A read on a job's own thread stops retrying once the job is given up (nobody waits for
    it then), while the reads of other jobs in the process go on."""
    from shardkit import storage

    given_up, other = threading.Event(), threading.Event()
    calls: list[int] = []

    def flaky() -> bytes:  # a store resetting every connection
        calls.append(1)
        if len(calls) == 2:
            given_up.set()
        raise ConnectionResetError(104, "Connection reset by peer")

    executors.init_worker(None)  # the retries ask executors.stop_point, as in a pack
    with pytest.raises(executors.Stopped):
        executors.working_for(given_up, storage.retrying, "s3://bucket/a.jpg", flaky)
    assert len(calls) == 2
    calls.clear()
    with pytest.raises(ShardkitError, match=r"s3://bucket/b\.jpg: ConnectionResetError.*gave up after 3 attempts"):
        executors.working_for(other, storage.retrying, "s3://bucket/b.jpg", flaky, 3, 0.001)
    assert len(calls) == 3 and not other.is_set()


def test_threads_refuse_truncated_images_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's threads set PIL's process-wide LOAD_TRUNCATED_IMAGES aside together: a
    truncated image checked while another thread finishes a good one is still refused, and
    the caller's setting comes back."""
    from PIL import ImageFile

    from shardkit.packing import images

    rng = np.random.default_rng(0)

    def jpeg(side: int) -> bytes:
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(out, "JPEG")
        return out.getvalue()

    good, bad = jpeg(400), jpeg(1200)
    bad = bad[: len(bad) * 9 // 10]
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)

    def check(start: threading.Barrier, verdicts: dict, name: str, data: bytes, delay: float) -> None:
        start.wait()
        time.sleep(delay)  # the bad one starts while the good one decodes
        try:
            images.check(data, "jpg", decode=True)
            verdicts[name] = "ok"
        except images.BadImage as e:
            verdicts[name] = str(e)

    for _ in range(30):
        start, verdicts = threading.Barrier(2), {}
        threads = [
            threading.Thread(target=check, args=(start, verdicts, "good", good, 0)),
            threading.Thread(target=check, args=(start, verdicts, "bad", bad, 0.001)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert verdicts == {"good": "ok", "bad": "truncated image"}
        assert ImageFile.LOAD_TRUNCATED_IMAGES is True


@pytest.mark.parametrize("options", [{"resize": 32}, {"decode_check": True}])
def test_one_shard_of_heavy_work_keeps_every_worker_busy(
    photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict
) -> None:
    """Re-encoding or decode-checking a pack of one shard spreads its images over `workers`
    threads: the same bytes and the same skips as one worker, in order."""
    from shardkit.packing import images

    whole = (photos / "circle" / "img_0003.jpg").read_bytes()
    (photos / "circle" / "img_0003.jpg").write_bytes(whole[:300])
    (photos / "square" / "text.jpg").write_text("not an image")
    seen: set[int] = set()
    wanted, deadline = [1], [0.0]

    def watched(fn: Callable) -> Callable:  # the threads that do the work
        def call(*args: object, **kwargs: object) -> object:
            seen.add(threading.get_ident())
            while len(seen) < wanted[0] and time.monotonic() < deadline[0]:  # the pool's other threads
                time.sleep(0.005)  # take images meanwhile, however late they start
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(images, "reencode", watched(images.reencode))
    monkeypatch.setattr(images, "check", watched(images.check))
    one = shardkit.pack(str(photos), str(tmp_path / "one"), workers=1, progress=False, **options)
    assert len(seen) == 1
    seen.clear()
    wanted[0], deadline[0] = 3, time.monotonic() + 10
    three = shardkit.pack(str(photos), str(tmp_path / "three"), workers=3, progress=False, **options)
    assert len(three.shards) == 1 and len(seen) == 3
    assert tree_bytes(tmp_path / "one") == tree_bytes(tmp_path / "three")
    assert [s.path for s in three.skipped] == [s.path for s in one.skipped]
    assert {"circle/img_0003.jpg", "square/text.jpg"} <= {s.path for s in three.skipped}
    failures = []
    for workers in (1, 3):  # the first bad file in the pack's order, whatever the threads
        with pytest.raises(SourceError, match=r"(circle/img_0003|square/text)\.jpg: ") as failed:
            shardkit.pack(
                str(photos), str(tmp_path / "fail"), workers=workers, on_error="raise", progress=False, **options
            )
        failures.append(str(failed.value))
    assert failures[0] == failures[1]


def test_the_last_job_of_a_pack_gets_the_cores_the_others_leave(
    photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job still running once the others are done is lent their cores: 3 shards of heavy
    work on 2 workers, the last one re-encodes 2 images at a time when it runs alone, where
    it had one core all along (the same bytes)."""
    from shardkit.packing import images

    one = shardkit.pack(str(photos), str(tmp_path / "one"), max_count=10, workers=1, resize=32, progress=False)
    with tarfile.open(tmp_path / "one" / one.shards[-1].name) as t:
        paths = [json.loads(t.extractfile(m).read())["path"] for m in t.getmembers() if m.name.endswith(".json")]
    last = {(photos / p).read_bytes() for p in paths}  # the last job's images: slow ones
    log = tmp_path / "reencodes"
    now, lock = [0], threading.Lock()  # re-encodes under way in this (forked) worker process
    reencode = images.reencode

    def watched(data: bytes, *args: object) -> bytes:
        with lock, open(log, "a") as f:
            now[0] += 1
            f.write(f"{now[0]}\n")
        try:
            time.sleep(0.2 if data in last else 0.01)
            return reencode(data, *args)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(images, "reencode", watched)  # pool workers are forked from here
    two = shardkit.pack(str(photos), str(tmp_path / "two"), max_count=10, workers=2, resize=32, progress=False)
    assert tree_bytes(tmp_path / "one") == tree_bytes(tmp_path / "two") and len(two.shards) == 3
    assert max(int(line) for line in log.read_text().splitlines()) == 2  # (1 before: a core a process)


def test_pack_takes_paths(photos: Path, tmp_path: Path) -> None:
    idx = shardkit.pack(photos, tmp_path / "out", workers=1, progress=False)  # pathlib.Path, as the readers take
    assert idx.samples == 30 and shardkit.verify(tmp_path / "out") == []
    with pytest.raises(TypeError, match="dest must be a path or URL"):
        shardkit.pack(photos, "", progress=False)


def test_hidden_and_undecodable_names_are_skipped(photos: Path, tmp_path: Path) -> None:
    good = (photos / "circle" / "img_0000.jpg").read_bytes()
    (photos / "circle" / ".hidden.jpg").write_bytes(good)
    (photos / "circle" / ".ipynb_checkpoints").mkdir()
    (photos / "circle" / ".ipynb_checkpoints" / "x.jpg").write_bytes(good)
    (photos / ".trash").mkdir()
    (photos / "square" / os.fsdecode(b"bad\xff\xfename.jpg")).write_bytes(good)
    idx = shardkit.pack(str(photos), str(tmp_path / "out"), workers=1, progress=False)
    assert idx.samples == 30 and idx.classes == ("circle", "square", "triangle")
    assert {s.path: s.reason for s in idx.skipped} == {
        ".trash": "hidden entry ignored",
        "circle/.hidden.jpg": "hidden entry ignored",
        "circle/.ipynb_checkpoints": "hidden entry ignored",
        "square/bad\\xff\\xfename.jpg": "file name is not valid UTF-8",
    }


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_refuses_a_destination_inside_the_source(photos: Path, tmp_path: Path, fmt: str) -> None:
    shardkit.pack(str(photos), str(tmp_path / "ds"), format=fmt, workers=1, progress=False)
    before = tree_bytes(tmp_path / "ds")
    for src, dest in [
        (photos, photos / "_shards"),
        (tmp_path / "ds", tmp_path / "ds"),
        (tmp_path / "ds", tmp_path / "ds" / "sub"),
    ]:
        with pytest.raises(SourceError, match="destination (is the source|is inside the source)"):
            shardkit.pack(str(src), str(dest), format=fmt, workers=1, progress=False)
    assert not (photos / "_shards").exists()
    assert tree_bytes(tmp_path / "ds") == before


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_a_pack_that_keeps_nothing_fails_and_leaves_nothing(tmp_path: Path, fmt: str) -> None:
    """No unfinished pack is left behind for `info` to advise a rerun of: it would fail again."""
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "x.jpg").write_text("not an image")
    with pytest.raises(SourceError, match=r"no usable samples, 1 skipped \(first: a/x\.jpg: not an image file\)"):
        shardkit.pack(str(tmp_path / "src"), str(tmp_path / "out"), format=fmt, workers=1, progress=False)
    assert [p.name for p in (tmp_path / "out").iterdir()] == []


def test_refuses_a_foreign_destination(photos: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "thesis.pdf").write_text("precious")
    with pytest.raises(SourceError, match="not empty"):
        shardkit.pack(str(photos), str(tmp_path / "out"), progress=False)
    assert (tmp_path / "out" / "thesis.pdf").read_text() == "precious"


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_a_hidden_file_in_the_destination_is_left_alone(photos: Path, tmp_path: Path, fmt: str) -> None:
    """A Finder's .DS_Store is no reason to refuse DEST (SRC ignores hidden entries too),
    and the pack neither reads nor removes it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".DS_Store").write_bytes(b"finder")
    idx = shardkit.pack(str(photos), str(out), format=fmt, workers=1, progress=False)
    assert idx.samples == 30 and (out / ".DS_Store").read_bytes() == b"finder"
    assert shardkit.pack(str(photos), str(out), format=fmt, workers=1, progress=False).samples == 30


def test_rerun_reuses_shards_and_repairs_damage(photos: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shardkit.pack(str(photos), str(out), max_count=4, workers=2, progress=False)
    clean = tree_bytes(out)
    # simulate a crash: index never written, one shard missing, one without its record,
    # a stale temporary file lying around
    (out / "index.json").unlink()
    (out / "shard-000002.tar").unlink()
    (out / "shard-000005.tar.tmp-0123456789ab").write_bytes(b"half a shard")
    (out / ".shardkit-progress").mkdir()
    before = (out / "shard-000000.tar").stat().st_mtime_ns
    shardkit.pack(str(photos), str(out), max_count=4, workers=2, progress=False)
    assert tree_bytes(out) == clean
    assert not (out / ".shardkit-progress").exists()
    assert (out / "shard-000000.tar").stat().st_mtime_ns != before  # no record: rewritten, same bytes


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_changed_options_replace_a_dataset_only_with_overwrite(photos: Path, tmp_path: Path, fmt: str) -> None:
    out = tmp_path / "out"
    shardkit.pack(str(photos), str(out), format=fmt, max_count=4, workers=1, progress=False)
    before = tree_bytes(out)
    with pytest.raises(SourceError, match=r"out: already holds a different dataset \(30 samples.*--overwrite"):
        shardkit.pack(str(photos), str(out), format=fmt, max_count=20, seed=1, workers=1, progress=False)
    assert tree_bytes(out) == before  # refused before anything was touched
    stats: dict[str, int] = {}
    idx = shardkit.pack(
        str(photos), str(out), format=fmt, max_count=20, seed=1, workers=1, progress=False, overwrite=True, stats=stats
    )
    assert idx.samples == 30 and stats == {"kept": 0, "written": 30, "unchanged": 0}
    if fmt == "tar":
        assert sorted(p.name for p in out.iterdir()) == [
            "index.json",
            idx.offsets_file.file,
            "shard-000000.tar",
            "shard-000001.tar",
        ]  # the old sidecar gone too
    assert [s["__key__"] for s in shardkit.StreamingDataset(str(out))] != []
    shardkit.pack(str(photos), str(out), format=fmt, max_count=20, seed=1, workers=1, progress=False, stats=stats)
    assert stats == {
        "kept": 30,
        "written": 0,
        "unchanged": 1,
    }  # the same pack again: nothing to do, no overwrite needed


def test_kill_at_any_moment_then_rerun(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "src", per_class=120)  # 90 shards: the last kill still lands mid-run under load
    reference = tmp_path / "ref"
    shardkit.pack(str(src), str(reference), max_count=4, workers=1, progress=False)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "shardkit.cli", "pack", str(src), str(out), "--max-count", "4", "--workers", "2", "-q"]
    interrupted = 0
    for target in (1, 15, 40):  # kill once this many shards exist
        proc = subprocess.Popen(cmd, start_new_session=True)
        while proc.poll() is None and len(list(out.glob("shard-*.tar"))) < target:
            time.sleep(0.001)
        kill_group(proc)
        interrupted += not (out / "index.json").exists()
    assert interrupted >= 2  # the kills really landed mid-run
    subprocess.run(cmd, check=True)
    assert tree_bytes(out) == tree_bytes(reference)


def test_killing_the_pack_process_stops_its_workers(tmp_path: Path) -> None:
    """SIGKILL on `shardkit pack` alone (not its process group) runs no cleanup: the pool
    workers must still go (the kernel signals them when their parent dies)."""
    src = make_folder(tmp_path / "src", per_class=150)
    cmd = [
        sys.executable,
        "-m",
        "shardkit.cli",
        "pack",
        str(src),
        str(tmp_path / "out"),
        "--max-count",
        "1",
        "--workers",
        "2",
        "-q",
    ]
    proc = subprocess.Popen(cmd, start_new_session=True)
    children: list[int] = []
    deadline = time.monotonic() + 60
    while proc.poll() is None and len(children) < 2 and time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            children = [int(c) for c in f.read().split()]
        time.sleep(0.01)
    time.sleep(0.3)  # the workers are packing
    proc.kill()
    proc.wait()
    assert len(children) >= 2

    def alive() -> list[int]:
        return [
            c for c in children if Path(f"/proc/{c}").exists() and Path(f"/proc/{c}/stat").read_text().split()[2] != "Z"
        ]

    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert not alive()
    finally:
        for c in alive():
            os.kill(c, signal.SIGKILL)


def _job_that_fails_or_waits(job: int) -> int:
    if job == 0:
        time.sleep(0.2)  # the other jobs are under way
        raise SourceError("job 0 failed")
    while True:  # until the pack gives up
        executors.stop_point()
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_a_failed_job_ends_the_jobs_in_flight() -> None:
    """Not a wait for jobs that could run for minutes (or forever) before the error shows."""
    start = time.monotonic()
    with pytest.raises(SourceError, match="job 0 failed"):
        executors.local(2)(_job_that_fails_or_waits, list(range(6)), lambda r: None, lambda n: None)
    assert time.monotonic() - start < 30  # (a pool's start included; the jobs in flight would never end)


_ALONGSIDE: Any = None  # the barrier the next test's jobs meet at (inherited by the pool's forked processes)


def _job_that_meets_the_others(job: int) -> int:
    _ALONGSIDE.wait(timeout=30)  # BrokenBarrierError unless as many jobs run at once
    return os.getpid()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("jobs", "together"), [(9, 9), (40, 8)])
def test_an_upload_runs_a_small_packs_jobs_at_once_a_large_ones_four_a_core(jobs: int, together: int) -> None:
    """Into an object store, 2 workers: 9 shards all at once (a last wave of one would have
    the link to itself), 40 in waves of 8 (4 a core: more contend, measured)."""
    global _ALONGSIDE
    assert executors.uploading_processes(2, jobs) == together
    assert executors.uploading_processes(16, 10_000) == executors.MOST_UPLOADING
    assert executors.uploading_processes(96, 10_000) == 96  # never fewer than a local pack's
    _ALONGSIDE = multiprocessing.get_context("fork").Barrier(together)
    pids: list[int] = []
    executors.local(2, uploading=True)(_job_that_meets_the_others, list(range(jobs)), pids.append, lambda n: None)
    assert len(pids) == jobs and len(set(pids)) == together  # that many processes, no more


_INTERRUPTED_POOL = """
import os, sys, time
from shardkit.packing import executors

def job(i):
    open(os.path.join(sys.argv[1], str(i)), "w").close()
    while True:
        executors.stop_point()
        time.sleep(0.01)

executors.local(2)(job, list(range(8)), print, lambda n: None)
"""


def _foreground(*args: str) -> subprocess.Popen[str]:
    """A Python script in a session of its own, Ctrl-C at Python's default, as a terminal's
    foreground job: `os.killpg(proc.pid, signal.SIGINT)` is the terminal's Ctrl-C."""
    return subprocess.Popen(
        [sys.executable, *args],
        start_new_session=True,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _until(done: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_ctrl_c_ends_a_pool_at_once_with_one_traceback(tmp_path: Path) -> None:
    """The terminal sends SIGINT to the whole process group: the workers leave it to the
    pack process, which ends their jobs; none is cut off halfway through sending a result
    (the pool's shutdown would then wait forever for the rest of it)."""
    script = tmp_path / "pool.py"
    script.write_text(_INTERRUPTED_POOL)
    started = tmp_path / "started"
    started.mkdir()
    proc = _foreground(str(script), str(started))
    _until(lambda: len(list(started.iterdir())) >= 2, 60)
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
        workers = [int(c) for c in f.read().split()]
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode != 0 and err.count("Traceback") == 1 and err.rstrip().endswith("KeyboardInterrupt")
    assert len(workers) == 2 and not any(Path(f"/proc/{w}").exists() for w in workers)


def test_a_pack_given_up_tries_a_failing_read_no_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool worker's remote read stops retrying once the pack process raised the stop flag:
    a stalled connection takes a minute an attempt, and Ctrl-C would wait out five."""
    import multiprocessing

    from shardkit import storage

    attempts = []

    def reset() -> None:
        attempts.append(1)
        raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr(executors, "_stop", multiprocessing.RawValue("b", 1))
    storage.stop_when(executors.stop_point)  # as a pool worker's start (init_worker) has it
    with pytest.raises(executors.Stopped):
        storage.retrying("s3://b/x", reset)
    assert len(attempts) == 1


_INTERRUPTED_START = """
import os, signal, sys, threading, time
from concurrent.futures import process
from shardkit.packing import executors

if sys.argv[1:] == ["bystander"]:  # a thread that does not block SIGINT (tqdm's monitor): it may take it
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()

launch = process.ProcessPoolExecutor._launch_processes

def launch_then_ctrl_c(self):  # Ctrl-C once the workers are forked, before the pool's thread starts
    launch(self)
    time.sleep(0.3)
    os.killpg(0, signal.SIGINT)
    time.sleep(0.1)

process.ProcessPoolExecutor._launch_processes = launch_then_ctrl_c

def job(i):
    return i

executors.local(2)(job, list(range(4)), print, lambda n: None)
"""


@pytest.mark.parametrize("threads", [[], ["bystander"]])
def test_ctrl_c_as_the_pool_starts_ends_it_too(tmp_path: Path, threads: list[str]) -> None:
    """Interrupted there, the pool had workers but not the thread that tells them to stop;
    they waited for work forever, and so did the pack's exit. With another thread that
    takes signals (every pack has one: tqdm's monitor), blocking SIGINT in the main thread
    alone did not hold it back."""
    script = tmp_path / "start.py"
    script.write_text(_INTERRUPTED_START)
    proc = _foreground(str(script), *threads)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0 and err.rstrip().endswith("KeyboardInterrupt")


_ORPHANED_START = """
import multiprocessing, os, sys, time
from shardkit.packing import executors

def worker(marker):
    time.sleep(1)  # its parent is gone before it asks to die with it
    executors._die_with_parent()
    open(marker, "w").close()

def parent(marker):
    multiprocessing.get_context("fork").Process(target=worker, args=(marker,)).start()
    os._exit(0)

if __name__ == "__main__":
    p = multiprocessing.get_context("fork").Process(target=parent, args=(sys.argv[1],))
    p.start()
    p.join()
    time.sleep(3)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_pool_worker_whose_parent_died_before_it_started_exits(tmp_path: Path) -> None:
    """The parent's death signal is asked for in the worker's initializer; a parent killed
    between the fork and that never sends it, and the worker would wait for work forever."""
    script, marker = tmp_path / "orphan.py", tmp_path / "survived"
    script.write_text(_ORPHANED_START)
    subprocess.run([sys.executable, str(script), str(marker)], check=True, timeout=60)
    assert not marker.exists()


_STALLED_PACK = """
import os, sys, time
from shardkit import cli

def stalled(job, check=None):  # a remote read that never answers: no next image, no stop point
    open(os.path.join(sys.argv[3], str(os.getpid())), "w").close()
    time.sleep(600)
    yield

sys.modules["shardkit.packing.jobs"].job_samples = stalled
cli.run(["pack", sys.argv[1], sys.argv[2], "--workers", "2", "--max-count", "5", "-q"])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pool workers die with the pack process on Linux")
def test_a_second_ctrl_c_ends_a_stalled_pack_at_once(photos: Path, tmp_path: Path) -> None:
    """The first Ctrl-C waits for the jobs in flight to reach their next image (a stalled read
    can put that off by a minute); the second exits at once, as a kill would, and a rerun
    finishes the pack."""
    script, started, out = tmp_path / "stalled.py", tmp_path / "started", tmp_path / "out"
    script.write_text(_STALLED_PACK)
    started.mkdir()
    proc = _foreground(str(script), str(photos), str(out), str(started))
    try:
        _until(lambda: len(list(started.iterdir())) >= 2, 60)
        workers = [int(p.name) for p in started.iterdir()]
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(1)
        assert proc.poll() is None, "the first Ctrl-C waits for the jobs in flight"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and err.strip() == "interrupted again: exiting now (a rerun of pack resumes)"
    _until(lambda: not any(Path(f"/proc/{w}").exists() for w in workers), 10)
    assert len(workers) == 2 and not any(Path(f"/proc/{w}").exists() for w in workers)
    shardkit.pack(str(photos), str(out), max_count=5, workers=2, progress=False)
    assert shardkit.verify(str(out)) == [] and shardkit.index.load(str(out)).samples == 30


def test_verify_catches_a_flipped_byte(photos: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shardkit.pack(str(photos), str(out), max_count=10, workers=1, progress=False)
    assert shardkit.verify(str(out)) == []
    shard = out / "shard-000001.tar"
    data = bytearray(shard.read_bytes())
    data[2000] ^= 0x01
    shard.write_bytes(bytes(data))
    problems = shardkit.verify(str(out))
    assert len(problems) == 1 and "shard-000001.tar" in problems[0] and "sha256" in problems[0]
    (out / "shard-000002.tar").unlink()
    assert any("shard-000002.tar: missing" in p for p in shardkit.verify(str(out)))


def test_a_conversion_does_not_copy_damage_into_fresh_checksums(
    photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard being converted that does not match its index has its samples skipped, each
    listed (or stops the pack under "raise"), rather than copied into shards that `verify`
    would then pass; once repaired, a rerun packs it; a shard gone stops the pack, as it
    stops a reader."""
    src = tmp_path / "src"
    shardkit.pack(str(photos), str(src), max_count=10, workers=1, progress=False)
    shard = src / "shard-000001.tar"
    data = bytearray(shard.read_bytes())
    data[2000] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(SourceError, match=r"shard-000001\.tar@0:\d+: source shard shard-000001\.tar: sha256 mismatch"):
        shardkit.pack(str(src), str(tmp_path / "fail"), on_error="raise", workers=1, progress=False)
    for fmt in ("tar", "lmdb"):
        idx = shardkit.pack(str(src), str(tmp_path / fmt), format=fmt, workers=2, progress=False)
        assert idx.samples == 20 and len(idx.skipped) == 10 and shardkit.verify(str(tmp_path / fmt)) == []
        assert all(s.path.startswith("shard-000001.tar@") and "sha256 mismatch" in s.reason for s in idx.skipped)
    shard.write_bytes(bytes(data[:2000]) + bytes([data[2000] ^ 0x01]) + bytes(data[2001:]))  # repaired
    for fmt in ("tar", "lmdb"):  # what was left out for the damage is not kept: the plan's fingerprint cannot tell
        assert shardkit.pack(str(src), str(tmp_path / fmt), format=fmt, workers=1, progress=False).samples == 30
    data[2000] ^= 0x01
    shard.write_bytes(bytes(data))  # damaged again; a conversion killed before its commit, then repaired
    with monkeypatch.context() as m:
        m.setattr(shardkit.index, "save", lambda *args, **kwargs: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            shardkit.pack(str(src), str(tmp_path / "killed"), max_count=5, workers=1, progress=False)
    shard.write_bytes(bytes(data[:2000]) + bytes([data[2000] ^ 0x01]) + bytes(data[2001:]))
    idx = shardkit.pack(str(src), str(tmp_path / "killed"), max_count=5, workers=1, progress=False)
    assert idx.samples == 30 and idx.skipped == ()
    (src / "shard-000002.tar").unlink()
    with pytest.raises(SourceError, match=r"shard-000002\.tar: missing \(a shard of the dataset being converted\)"):
        shardkit.pack(str(src), str(tmp_path / "gone"), workers=1, progress=False)
    assert not (tmp_path / "gone" / "index.json").exists()


def test_build_index_for_foreign_shards(tmp_path: Path) -> None:
    import webdataset as wds

    (tmp_path / "wds").mkdir()
    with wds.ShardWriter(str(tmp_path / "wds" / "part-%06d.tar"), maxcount=4, verbose=0) as sink:
        for i in range(10):
            sink.write({"__key__": f"sample{i:03d}", "jpg": b"x" * (i + 1), "cls": str(i % 3)})
    from shardkit.index.resolve import build_index, shard_urls

    idx = build_index(shard_urls(str(tmp_path / "wds")))
    assert [s.samples for s in idx.shards] == [4, 4, 2]
    assert idx.fields == ("cls", "jpg")
    with tarfile.open(tmp_path / "wds" / "part-000000.tar") as t:
        first = t.getmembers()[0]
    assert idx.shards[0].offsets[0] == 0 and first.name.startswith("sample000")


def test_foreign_keys_survive_conversion_both_ways(photos: Path, tmp_path: Path) -> None:
    """Keys that other tars carry (folders, `./`, paths past ustar's 100-byte name field,
    written with its prefix field or a pax header) convert tar -> tar and tar -> lmdb -> tar."""
    src = tmp_path / "src"
    deep = "d" * 70 + "/" + "e" * 70
    for i, jpg in enumerate(sorted(photos.glob("*/*.jpg"))[:4]):
        folder = src / ("bird" if i % 2 else deep)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"img{i}.jpg").write_bytes(jpg.read_bytes())
    (tmp_path / "plain").mkdir()
    for fmt, name, top in ((tarfile.USTAR_FORMAT, "a.tar", "."), (tarfile.PAX_FORMAT, "b.tar", "pax")):
        with tarfile.open(tmp_path / "plain" / name, "w", format=fmt) as t:
            t.add(src, arcname=top)
    from shardkit.index.resolve import build_index, shard_urls

    shardkit.index.save(build_index(shard_urls(str(tmp_path / "plain"))), str(tmp_path / "plain"))
    want = {(s["__key__"], s["jpg"]) for s in shardkit.StreamingDataset(str(tmp_path / "plain"))}
    keys = {"bird/img1", "bird/img3", f"{deep}/img0", f"{deep}/img2"}
    assert len(want) == 8 and {k for k, _ in want} == {f"{top}/{k}" for top in (".", "pax") for k in keys}
    shardkit.pack(str(tmp_path / "plain"), str(tmp_path / "t2"), workers=1, progress=False)
    shardkit.pack(str(tmp_path / "plain"), str(tmp_path / "l"), format="lmdb", workers=1, progress=False)
    shardkit.pack(str(tmp_path / "l"), str(tmp_path / "t3"), workers=1, progress=False)
    for out in ("t2", "l", "t3"):
        got = [(s["__key__"], s["jpg"]) for s in shardkit.StreamingDataset(str(tmp_path / out))]
        assert len(got) == 8 and set(got) == want  # each sample once (LMDB refuses a key that comes twice)
    shards = {n: b for n, b in tree_bytes(tmp_path / "t2").items() if n.endswith(".tar")}
    assert shards and shards == {n: b for n, b in tree_bytes(tmp_path / "t3").items() if n.endswith(".tar")}
    with tarfile.open(tmp_path / "t2" / "shard-000000.tar") as t:  # other readers see the long names
        assert f"./{deep}/img0.jpg" in t.getnames()


_SHARD = {"name": "a.tar", "samples": 2, "bytes": 4096}


@pytest.mark.parametrize(
    "doc, message",
    [
        ("{not json", "not valid JSON"),
        ({"format": "other"}, "not a shardkit index"),
        ({"shards": "a.tar"}, "malformed index"),
        ({"shards": [["a.tar", 2]]}, "malformed index"),
        ({"shards": [{**_SHARD, "offsets": ["0", "1024", "2048"]}]}, "malformed index"),
        ({"shards": [{**_SHARD, "offsets": [0, 1024, 2**63]}]}, "malformed index"),
        ({"shards": [{**_SHARD, "offsets": [0, 1024]}]}, "a.tar: index lists 2 offsets for 2 samples"),
        ({"shards": [{**_SHARD, "offsets": [0, 1024, 2048]}], "samples": 3}, "total 3 samples"),
        ({"shards": [{**_SHARD, "samples": -1}]}, "a.tar: index lists -1 samples"),
        ({"shards": [{**_SHARD, "offsets": [-512, 1024, 2048]}]}, "a.tar: index offsets run from -512 to 2048"),
        ({"shards": [{**_SHARD, "offsets": [0, 1024, 8192]}]}, "outside the shard's 4096 bytes"),
        ({"shards": [{**_SHARD, "offsets": [0, 2048, 1024]}]}, "a.tar: index offsets do not increase at sample 1"),
        ({"shards": [{**_SHARD, "offsets": [0, 0, 1024]}]}, "do not increase at sample 0 (0 then 0)"),
        (
            {"shards": [{**_SHARD, "name": "../a.tar"}]},
            "shard name '../a.tar' is not the name of a file in the dataset's",
        ),
        ({"shards": [{**_SHARD, "name": ".."}]}, "shard name '..' is not the name of a file"),
        ({"shards": [_SHARD, _SHARD]}, "shard 'a.tar' is listed twice"),
        ({"version": 2, "shards": [_SHARD]}, "a version 2 index of tar shards names no file of sample offsets"),
        (
            {"version": 2, "offsets": {"file": "../offsets-0123456789abcdef.npy", "sha256": "0"}, "shards": [_SHARD]},
            "\"offsets\" names '../offsets-0123456789abcdef.npy', not a shardkit offsets file of the folder",
        ),
        ({"version": 2, "offsets": {"file": "offsets-0123456789abcdef.npy"}, "shards": [_SHARD]}, "malformed index"),
        (
            {
                "version": 2,
                "offsets": {"file": "offsets-0123456789abcdef.npy", "sha256": "0"},
                "shards": [{**_SHARD, "offsets": [0, 1024, 2048]}],
            },
            "lists sample offsets both in its shards and in",
        ),
    ],
)
def test_a_malformed_index_is_one_line_naming_it(tmp_path: Path, doc: object, message: str) -> None:
    if isinstance(doc, dict):
        doc = json.dumps({"format": "shardkit", "version": 1, **doc})
    (tmp_path / "index.json").write_text(str(doc))
    with pytest.raises(shardkit.CorruptShardError) as err:
        shardkit.StreamingDataset(str(tmp_path))
    text = str(err.value)
    assert text.startswith(str(tmp_path / "index.json")) and message in text and "\n" not in text


def test_index_json_keeps_its_version_through_a_round_trip(packed: Path, packed_v1: Path, tmp_path: Path) -> None:
    """A version 1 index reads and prints as version 1 (offsets inside, as `info --json`
    shows it), a version 2 one as version 2; saving either writes version 2 and its sidecar."""
    for folder, version in ((packed_v1, 1), (packed, 2)):
        text = (folder / "index.json").read_text()
        idx = shardkit.index.Index.from_json(text)
        assert json.loads(idx.to_json()) == json.loads(text) and json.loads(text)["version"] == version
    out = tmp_path / "out"
    out.mkdir()
    saved = shardkit.index.save(shardkit.index.load(str(packed_v1)), str(out))
    assert (out / "index.json").read_text() == (packed / "index.json").read_text()
    assert (out / saved.offsets_file.file).read_bytes() == (packed / saved.offsets_file.file).read_bytes()
    with pytest.raises(shardkit.ShardkitError, match="not saved: shards without sample offsets"):
        shardkit.index.save(replace(shardkit.index.load(str(packed_v1)).slim(), offsets_file=None), str(out))


def test_a_newer_index_version_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "index.json").write_text(json.dumps({"format": "shardkit", "version": 3, "shards": []}))
    with pytest.raises(
        shardkit.IndexVersionError,
        match=r"index version 3, this shardkit reads versions 1 to 2; "
        "upgrade shardkit",
    ):
        shardkit.StreamingDataset(str(tmp_path))


def test_an_index_a_reader_would_refuse_is_not_written(packed: Path, tmp_path: Path) -> None:
    """A shard listed twice (shards of two folders with one name: an index that reads them
    both, not one to save); a backslash is a file name like any other on POSIX."""
    (tmp_path / "a").mkdir()
    shutil.copy(packed / "shard-000000.tar", tmp_path / "a" / "part\\1.tar")
    shardkit.index.save(shardkit.build_index([str(tmp_path / "a" / "part\\1.tar")]), str(tmp_path / "a"))
    assert len(shardkit.StreamingDataset(str(tmp_path / "a"))) == shardkit.index.load(str(packed)).shards[0].samples
    one = shardkit.build_index(str(packed / "shard-000000.tar")).shards[0]
    with pytest.raises(shardkit.CorruptShardError, match="shard 'shard-000000.tar' is listed twice"):
        shardkit.index.save(shardkit.index.Index(shards=(one, one)), str(tmp_path / "b"))
    assert not (tmp_path / "b" / "index.json").exists()


def test_an_index_that_is_a_folder_is_named(tmp_path: Path) -> None:
    (tmp_path / "index.json").mkdir()
    with pytest.raises(IsADirectoryError, match=re.escape(str(tmp_path / "index.json"))):
        shardkit.StreamingDataset(str(tmp_path))


def test_an_unreadable_index_in_dest_is_replaced_only_with_overwrite(photos: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shardkit.pack(str(photos), str(out), workers=1, progress=False)
    (out / "index.json").write_text("{garbage")
    with pytest.raises(
        SourceError, match=r"out: already holds an index.json that cannot be read; rerun with --overwrite"
    ):
        shardkit.pack(str(photos), str(out), workers=1, progress=False)
    assert (out / "index.json").read_text() == "{garbage"
    assert shardkit.pack(str(photos), str(out), workers=1, progress=False, overwrite=True).samples == 30


def test_a_rerun_after_a_crash_before_the_index_commits_it(
    photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(shardkit.index, "save", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("killed")))
        with pytest.raises(RuntimeError, match="killed"):
            shardkit.pack(str(photos), str(out), max_count=8, workers=1, progress=False)
    assert not (out / "index.json").exists() and len(list(out.glob("*.tar"))) == 4
    stats: dict[str, int] = {}
    assert shardkit.pack(str(photos), str(out), max_count=8, workers=1, progress=False, stats=stats).samples == 30
    assert stats == {"kept": 30, "written": 0, "unchanged": 0} and (out / "index.json").exists()


def test_an_lmdb_whose_index_json_is_damaged_is_repaired_by_the_same_pack(photos: Path, tmp_path: Path) -> None:
    out = tmp_path / "db"
    shardkit.pack(str(photos), str(out), format="lmdb", workers=1, progress=False)
    good = (out / "index.json").read_text()
    (out / "index.json").write_text("{garbage")
    shardkit.pack(str(photos), str(out), format="lmdb", workers=1, progress=False)  # the copy inside the LMDB decides
    assert (out / "index.json").read_text() == good


def _same_size_folder(root: Path) -> Path:
    """2 classes x 10 BMPs of one size: every shard of a pack has the same length, whatever the order."""
    from PIL import Image

    for c in range(2):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(10):
            Image.new("RGB", (8, 8), (c * 100, i * 20, 7)).save(root / f"c{c}" / f"{i}.bmp")
    return root


def _index_folder(folder: Path) -> None:
    """What `shardkit index FOLDER` does."""
    from shardkit.index.resolve import shard_urls

    shardkit.index.save(shardkit.build_index(shard_urls(str(folder))), str(folder))


def _crash(*args: object, **kwargs: object) -> None:
    raise RuntimeError("killed")


def test_a_crash_between_a_shard_and_its_record_leaves_no_stale_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardkit import storage

    src, out = _same_size_folder(tmp_path / "src"), tmp_path / "out"
    shardkit.pack(str(src), str(tmp_path / "clean"), max_count=5, workers=1, progress=False)
    with monkeypatch.context() as m:  # seed 0 stops before its commit: its records stay
        m.setattr(shardkit.index, "save", _crash)
        with pytest.raises(RuntimeError):
            shardkit.pack(str(src), str(out), max_count=5, workers=1, progress=False)
    write = storage.write_bytes_atomic

    def crash_at_first_record(url: str, *args: object) -> None:
        if "shard-000000.tar.json" in url:
            raise RuntimeError("killed")
        write(url, *args)

    with monkeypatch.context() as m:  # seed 1 renames its first shard into place and dies before its record
        m.setattr(storage, "write_bytes_atomic", crash_at_first_record)
        with pytest.raises(RuntimeError):
            shardkit.pack(str(src), str(out), max_count=5, seed=1, workers=1, progress=False)
    stats: dict[str, int] = {}
    shardkit.pack(str(src), str(out), max_count=5, workers=1, progress=False, stats=stats)
    assert tree_bytes(out) == tree_bytes(tmp_path / "clean")
    assert stats["written"] == 5  # seed 0's record of shard 0 went before seed 1 wrote over it


def test_a_record_that_landed_before_its_table_never_vouches_for_an_earlier_table(
    photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard's offsets table and its record are written at once: where the record lands
    and the table does not (a crash between), the earlier run's table of the same size must
    not be taken for this run's. Seed 0 stops before its commit (its records and tables
    stay); seed 1 dies writing its first table once its first record is in place; its rerun
    ends as a clean pack of seed 1 does (images of many sizes: the two seeds' tables differ)."""
    from shardkit import storage

    src, out = photos, tmp_path / "out"
    shardkit.pack(str(src), str(tmp_path / "clean"), max_count=5, seed=1, workers=1, progress=False)
    with monkeypatch.context() as m:
        m.setattr(shardkit.index, "save", _crash)
        with pytest.raises(RuntimeError):
            shardkit.pack(str(src), str(out), max_count=5, workers=1, progress=False)
    record = out / ".shardkit-progress" / "shard-000000.tar.json"
    write = storage.write_bytes_atomic

    def table_dies_after_the_record(url: str, *args: object) -> None:
        if url.endswith("shard-000000.tar.offsets"):
            deadline = time.monotonic() + 10
            while not record.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            raise RuntimeError("killed")
        write(url, *args)

    with monkeypatch.context() as m:
        m.setattr(storage, "write_bytes_atomic", table_dies_after_the_record)
        with pytest.raises(RuntimeError):
            shardkit.pack(str(src), str(out), max_count=5, seed=1, workers=1, progress=False)
    assert record.exists()  # seed 1's record, beside no table of seed 1's
    shardkit.pack(str(src), str(out), max_count=5, seed=1, workers=1, progress=False)
    assert tree_bytes(out) == tree_bytes(tmp_path / "clean")


def test_shard_names_of_another_tool_are_not_taken_for_its_own(photos: Path, tmp_path: Path) -> None:
    out = tmp_path / "wds"
    out.mkdir()
    with tarfile.open(out / "shard-000000.tar", "w") as tar:  # as webdataset's ShardWriter names them
        tar.add(next(photos.rglob("*.jpg")), "0.jpg")
    (out / "results.tmp-2024.csv").write_text("precious")
    before = tree_bytes(out)
    with pytest.raises(
        SourceError,
        match=r"wds: destination is not empty and holds files `shardkit pack` did not "
        r"write \(found 'results.tmp-2024.csv'\)",
    ):
        shardkit.pack(str(photos), str(out), workers=1, progress=False)
    (out / "results.tmp-2024.csv").unlink()
    with pytest.raises(SourceError, match="found 'shard-000000.tar'"):  # no dataset here: not ours to replace
        shardkit.pack(str(photos), str(out), workers=1, progress=False, overwrite=True)
    assert (out / "shard-000000.tar").read_bytes() == before["shard-000000.tar"]
    _index_folder(out)  # indexed, they are a dataset: replaced with --overwrite only, as any other
    with pytest.raises(SourceError, match="already holds a different dataset"):
        shardkit.pack(str(photos), str(out), workers=1, progress=False)
    assert shardkit.pack(str(photos), str(out), workers=1, progress=False, overwrite=True).samples == 30


def test_a_pack_reindexed_with_index_force_is_replaced_with_overwrite(photos: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shardkit.pack(str(photos), str(out), max_count=8, workers=1, progress=False)
    _index_folder(out)  # `shardkit index --force`: the plan is gone from the index
    assert shardkit.pack(str(photos), str(out), max_count=8, workers=1, progress=False, overwrite=True).samples == 30


def test_hidden_files_added_to_the_source_leave_a_finished_pack_finished(photos: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shardkit.pack(str(photos), str(out), workers=1, progress=False)
    (photos / "circle" / ".DS_Store").write_bytes(b"finder")
    stats: dict[str, int] = {}
    shardkit.pack(str(photos), str(out), workers=1, progress=False, stats=stats)
    assert stats["unchanged"] == 1


def test_an_lmdb_of_another_tool_is_not_written_into(photos: Path, tmp_path: Path) -> None:
    import lmdb

    env = lmdb.open(str(tmp_path / "db"))
    with env.begin(write=True) as txn:
        txn.put(b"user-key", b"precious")
    env.close()
    before = (tmp_path / "db" / "data.mdb").read_bytes()
    with pytest.raises(SourceError, match=r"db: holds an LMDB that `shardkit pack` did not write"):
        shardkit.pack(str(photos), str(tmp_path / "db"), format="lmdb", workers=1, progress=False, overwrite=True)
    assert (tmp_path / "db" / "data.mdb").read_bytes() == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "labels.csv").write_text("a,b")
    with pytest.raises(
        SourceError, match=r"other: destination is not empty and not an LMDB dataset \(found 'labels.csv'\)"
    ):
        shardkit.pack(str(photos), str(tmp_path / "other"), format="lmdb", workers=1, progress=False)
    (tmp_path / "folder" / "data.mdb").mkdir(parents=True)  # LMDB's own error, on one line
    with pytest.raises(SourceError, match=r"folder: cannot write an LMDB there \(.*folder: Is a directory\)"):
        shardkit.pack(str(photos), str(tmp_path / "folder"), format="lmdb", workers=1, progress=False)


def test_an_lmdb_overwrite_killed_halfway_is_finished_by_a_rerun(photos: Path, tmp_path: Path) -> None:
    out = tmp_path / "db"
    shardkit.pack(str(photos), str(out), format="lmdb", workers=1, progress=False)
    (out / "index.json").unlink()  # an overwrite removes the index first, then the data: killed in between
    (out / "data.mdb").unlink()
    with pytest.raises(shardkit.DatasetNotFoundError):
        shardkit.LMDBDataset(str(out))  # no index left to mistake for the old dataset
    assert shardkit.pack(str(photos), str(out), format="lmdb", seed=1, workers=1, progress=False).samples == 30


def test_a_rerun_after_a_crash_in_the_cleanup_finishes_it(
    photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    shardkit.pack(str(photos), str(out), max_count=4, workers=1, progress=False)
    with monkeypatch.context() as m:
        m.setattr(sys.modules["shardkit.packing.sinks.tar"], "cleanup", _crash)
        with pytest.raises(RuntimeError):
            shardkit.pack(str(photos), str(out), max_count=20, workers=1, progress=False, overwrite=True)
    assert (out / ".shardkit-progress").exists() and len(list(out.glob("*.tar"))) == 8
    assert len(shardkit.StreamingDataset(str(out))) == 30  # committed: readers take it already
    idx = shardkit.pack(str(photos), str(out), max_count=20, workers=1, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "index.json",
        idx.offsets_file.file,
        "shard-000000.tar",
        "shard-000001.tar",
    ]


def test_files_the_scan_leaves_out_are_part_of_what_makes_a_pack_the_same(photos: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shardkit.pack(str(photos), str(out), workers=1, progress=False)
    (photos / "circle" / "notes.txt").write_text("a note")
    with pytest.raises(SourceError, match="already holds a different dataset"):
        shardkit.pack(str(photos), str(out), workers=1, progress=False)
    idx = shardkit.pack(str(photos), str(out), workers=1, progress=False, overwrite=True)
    assert [s.path for s in idx.skipped] == ["circle/notes.txt"]


def test_a_foreign_sample_whose_key_cannot_be_written_is_skipped_and_listed(photos: Path, tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    jpg = next(photos.rglob("*.jpg"))
    with tarfile.open(foreign / "data-0.tar", "w") as tar:
        tar.add(jpg, "dir/0001.jpg")
        tar.add(jpg, "dir/.DS_Store")  # webdataset's key: 'dir/', no base name
    _index_folder(foreign)
    idx = shardkit.pack(str(foreign), str(tmp_path / "out"), workers=1, progress=False)
    assert idx.samples == 1 and len(idx.skipped) == 1
    assert "sample key must have a non-empty base name" in idx.skipped[0].reason
    with pytest.raises(SourceError, match=r"data-0.tar \(sample at byte \d+\): sample key must"):
        shardkit.pack(str(foreign), str(tmp_path / "out2"), workers=1, progress=False, on_error="raise")


def test_a_symlink_to_something_not_a_file_is_named_so(photos: Path, tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (photos / "circle" / "pipe.jpg").symlink_to(tmp_path / "fifo")
    (photos / "circle" / "gone.jpg").symlink_to(tmp_path / "nothing")
    idx = shardkit.pack(str(photos), str(tmp_path / "out"), workers=1, progress=False)
    reasons = {s.path: s.reason for s in idx.skipped}
    assert reasons == {"circle/pipe.jpg": "not a regular file", "circle/gone.jpg": "broken symlink"}


def test_images_every_reader_would_refuse_are_skipped_at_pack_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from PIL import Image, ImageFile

    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    for name, size in (("small.png", (8, 8)), ("small.jpg", (8, 8)), ("huge.png", (64, 64)), ("huge.jpg", (64, 64))):
        Image.new("RGB", size, (200, 30, 30)).save(src / name)
    whole = io.BytesIO()
    Image.effect_noise((30, 30), 40).convert("RGB").save(whole, "JPEG")
    thumbnail = b"Exif\x00\x00\xff\xd8" + bytes(64) + b"\xff\xd9"  # an EXIF thumbnail's end marker, early on
    app1 = b"\xff\xe1" + (len(thumbnail) + 2).to_bytes(2, "big") + thumbnail
    (src / "cut.jpg").write_bytes(whole.getvalue()[:2] + app1 + whole.getvalue()[2 : len(whole.getvalue()) // 2])
    (src / "bad.ppm").write_bytes(b"P6\n3Z 32\n255\n" + bytes(100))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 64x64 is past twice that: a decompression bomb
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)  # a notebook's setting must not let cut files in
    for options in ({}, {"quality": 90}, {"resize": 4}):
        idx = shardkit.pack(
            str(tmp_path / "src"),
            str(tmp_path / f"out{len(options)}{list(options)}"),
            workers=1,
            progress=False,
            **options,
        )
        reasons = {s.path: s.reason for s in idx.skipped}
        assert idx.samples == 2 and sorted(reasons) == ["a/bad.ppm", "a/cut.jpg", "a/huge.jpg", "a/huge.png"], options
        assert "decompression bomb" in reasons["a/huge.png"].lower() and reasons["a/cut.jpg"] == "truncated image"
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # the caller's setting, as it was


def test_index_sidecar_is_the_offsets_files_old_name(tmp_path: Path) -> None:
    """An image's companion files are its sidecars; the index's file of offsets is its
    offsets file, still read under its old name, with a warning."""
    from conftest import make_folder

    idx = shardkit.pack(str(make_folder(tmp_path / "src", per_class=2)), str(tmp_path / "out"), progress=False)
    assert idx.offsets_file is not None and (tmp_path / "out" / idx.offsets_file.file).is_file()
    with pytest.warns(DeprecationWarning, match="use Index.offsets_file"):
        assert idx.sidecar == idx.offsets_file
