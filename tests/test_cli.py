"""The `shardkit` command line, through click's CliRunner."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import tarfile
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import shardkit
from shardkit.cli import main

from conftest import CLASSES, draw


@pytest.fixture
def run():  # type: ignore[no-untyped-def]
    runner = CliRunner()

    def invoke(*args: str):  # type: ignore[no-untyped-def]
        return runner.invoke(main, [str(a) for a in args], catch_exceptions=False)

    return invoke


def test_pack_info_verify(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    result = run("pack", photos, out, "--max-count", "8", "--workers", "2")
    assert result.exit_code == 0, result.output
    assert "packed 30 samples into 4 shards" in result.output
    result = run("info", out)
    assert result.exit_code == 0
    assert "samples:  30" in result.output and "classes:  3 (circle, square, triangle)" in result.output
    doc = json.loads(run("info", out, "--json").output)
    assert doc["samples"] == 30 and len(doc["shards"]) == 4
    result = run("verify", out)
    assert result.exit_code == 0 and "all shards match the index" in result.output


def test_what_the_commands_say_comes_from_python(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The CLI is thin: a pack's warnings and info's summary are shardkit.tools.report's lines,
    from the same results, called in Python."""
    from shardkit import index, pack
    from shardkit.storage import display
    from shardkit.tools import report

    (photos / "circle" / ".DS_Store").write_bytes(b"x")
    (photos / "circle" / "notes.txt").write_text("not an image")
    said = run("pack", photos, tmp_path / "cli", "--max-count", "8", "-q").output
    idx = pack(str(photos), str(tmp_path / "py"), max_count=8, progress=False)
    assert said == "".join(f"{line}\n" for line in report.pack_warnings(idx, str(tmp_path / "cli"), "classes", True))
    lines = report.info_lines(index.load(str(tmp_path / "cli")), display(str(tmp_path / "cli")))
    assert run("info", tmp_path / "cli").output == "".join(f"{line}\n" for line in lines)
    assert "ignored:  1 hidden entry (circle/.DS_Store)" in lines


def test_the_summaries_say_what_they_count(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Shard sizes without '8-8', an LMDB not called shards, a Finder's .DS_Store not counted
    among the skipped files, a missing folder named as bench names it, -V."""
    (photos / "circle" / ".DS_Store").write_bytes(b"x")
    (photos / "circle" / "notes.txt").write_text("not an image")
    for max_count, line in (
        ("30", "shards:   1 (30 samples)\n"),
        ("10", "shards:   3 (10 samples each)\n"),
        ("8", "shards:   4 (7-8 samples each)\n"),
    ):
        out = tmp_path / f"by-{max_count}"
        result = run("pack", photos, out, "--max-count", max_count)
        assert result.output.endswith(
            "skipped 1 file:\n  circle/notes.txt: not an image file extension\n"
            "ignored 1 hidden entry (circle/.DS_Store)\n"
        ), result.output
        said = run("info", out).output
        assert line in said and said.endswith(
            "skipped:  1 file\n  circle/notes.txt: not an image file extension\n"
            "ignored:  1 hidden entry (circle/.DS_Store)\n"
        ), said
    run("pack", photos, tmp_path / "db", "--format", "lmdb", "-q")
    assert "shards:" not in run("info", tmp_path / "db").output
    assert run("verify", tmp_path / "db").output == "ok   data.mdb (30 samples)\ndata.mdb matches the index\n"
    for command in ("info", "verify", "bench"):
        result = run(command, tmp_path / "nope")
        assert (result.exit_code, result.output) == (1, f"Error: {tmp_path / 'nope'}: no such folder\n")
    assert run("-V").output == run("--version").output == f"main, version {shardkit.__version__}\n"
    info = shardkit.index.with_offsets(shardkit.index.load(str(tmp_path / "by-10"))).shards[0]
    assert (
        repr(info) == f"ShardInfo(name='shard-000000.tar', samples=10, bytes={info.bytes}, sha256={info.sha256!r}, "
        "offsets=<11 offsets>)"
    )


def test_verify_fails_naming_the_shard(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    run("pack", photos, out, "--max-count", "8", "-q")
    shard = out / "shard-000003.tar"
    shard.write_bytes(shard.read_bytes()[:-1024] + bytes(1024 - 1) + b"\x01")
    result = run("verify", out, "-q")
    assert result.exit_code == 1
    assert "shard-000003.tar: sha256 mismatch" in result.output


def test_verify_goes_on_past_a_shard_it_cannot_read(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    run("pack", photos, out, "--max-count", "8", "-q")
    (out / "shard-000001.tar").unlink()
    (out / "shard-000001.tar").mkdir()  # a folder in its place
    (out / "shard-000003.tar").unlink()
    (out / "shard-000009.tar").write_bytes(b"")
    result = run("verify", out)
    assert result.exit_code == 1
    assert "shard-000001.tar: Is a directory" in result.output and "shard-000003.tar: missing" in result.output
    assert "shard-000009.tar: a shard the index does not list" in result.output


def test_skipped_files_are_reported(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (photos / "circle" / "bad.jpg").write_bytes(b"nope")
    result = run("pack", photos, tmp_path / "out")
    assert result.exit_code == 0
    assert "skipped 1 file:" in result.output and "circle/bad.jpg: not an image file" in result.output
    assert "skipped:  1 file\n" in run("info", tmp_path / "out").output


def test_on_error_raise_exits_nonzero(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (photos / "circle" / "bad.jpg").write_bytes(b"nope")
    result = run("pack", photos, tmp_path / "out", "--on-error", "raise")
    assert result.exit_code == 1
    assert (
        result.output.strip()
        .splitlines()[-1]
        .endswith(
            "circle/bad.jpg: not an image file (--on-error raise; remove the file, or pack with --on-error skip to leave "
            "it out and list it in the index)"
        )
    )


def test_on_error_raise_on_a_stray_file_says_how_to_go_on(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (photos / "circle" / "notes.txt").write_text("not an image")
    result = run("pack", photos, tmp_path / "out", "--on-error", "raise")
    assert (
        result.exit_code == 1
        and "circle/notes.txt: not an image file extension (--on-error raise; remove the "
        "file, or pack with --on-error skip"
        in result.output
    )
    assert "no such folder" in run("pack", tmp_path / "missing", tmp_path / "x", "--on-error", "raise").output
    assert "--on-error skip" not in run("pack", tmp_path / "missing", tmp_path / "x", "--on-error", "raise").output


def test_a_flat_folder_packed_without_layout_flat_says_so(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """11 images beside one folder of one: a 1-sample pack, and a hint at --layout flat."""
    for i in range(11):
        draw(tmp_path / "src" / f"{i}.jpg", 0, seed=i)
    draw(tmp_path / "src" / "extra" / "0.jpg", 0, seed=99)
    result = run("pack", tmp_path / "src", tmp_path / "out")
    assert result.exit_code == 0 and "packed 1 sample into 1 shard" in result.output
    assert result.output.endswith(
        "hint: 11 files not inside a class folder, 1 sample packed: for images without "
        "classes (SRC/<image>), pack with --layout flat\n"
    ), result.output
    assert "hint:" in run("pack", tmp_path / "src", tmp_path / "out2", "-q").output
    assert "hint:" not in run("pack", tmp_path / "src", tmp_path / "flat", "--layout", "flat").output
    (tmp_path / "src" / "extra" / "0.jpg").unlink()
    (tmp_path / "src" / "extra" / "notes.txt").write_text("x")
    assert "no image files in 1 class folder\n" in run("pack", tmp_path / "src", tmp_path / "none").output


def test_info_on_shards_without_class_names_says_what_it_knows(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "wds").mkdir()
    with tarfile.open(tmp_path / "wds" / "part-000000.tar", "w") as tar:
        for name in ("k0.jpg", "k0.cls"):
            (tmp_path / name).write_bytes(b"1")
            tar.add(tmp_path / name, name)
    assert run("index", tmp_path / "wds").exit_code == 0
    assert (
        "classes:  unknown (the index names none; samples carry a cls field)\n" in run("info", tmp_path / "wds").output
    )
    for i in range(2):
        draw(tmp_path / "flat" / f"{i}.jpg", 0, seed=i)
    run("pack", tmp_path / "flat", tmp_path / "flat-out", "--layout", "flat", "-q")
    assert "classes:  none (no cls field)\n" in run("info", tmp_path / "flat-out").output


@pytest.mark.parametrize("command", ["pack", "info", "verify", "index", "bench", "preview"])
def test_every_command_shows_an_example(run, command: str) -> None:  # type: ignore[no-untyped-def]
    text = run(command, "--help").output
    assert f"Examples:\n    shardkit {command} " in text, text
    if command == "bench":
        assert "takes about 90 s" in " ".join(text.split())


@pytest.mark.parametrize(
    "args, code, text",
    [
        (["pack", "/nonexistent/photos", "/tmp/x"], 1, "Error: /nonexistent/photos: no such folder"),
        (["pack", ".", "/tmp/x", "--max-size", "lots"], 2, "not a size"),
        (["info", "/nonexistent/shards"], 1, "Error: /nonexistent/shards: no such folder"),
        (["pack", ".", "/tmp/x", "-o", "novalue"], 2, "expected key=value"),
    ],
)
def test_errors_are_one_line(run, args, code: int, text: str) -> None:  # type: ignore[no-untyped-def]
    result = run(*args)
    assert result.exit_code == code
    assert text in result.output
    assert "Traceback" not in result.output


def test_user_mistakes_are_one_line_errors(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Pointing at the wrong thing: a file where a folder goes, a shard or index.json
    instead of the dataset, an unknown protocol, a zero size."""
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "out"
    assert run("pack", photos, out, "-q").exit_code == 0
    for args, code, text in [
        (["pack", photos, tmp_path / "afile"], 1, "afile"),
        (["pack", photos, tmp_path / "afile", "--format", "lmdb"], 1, "afile"),
        (["verify", out / "shard-000000.tar"], 1, "shard-000000.tar: not a folder"),
        (["info", out / "index.json"], 1, "index.json: not a folder"),
        (["info", "s3x://bucket/data"], 1, "unknown storage protocol s3x://"),
        (["pack", photos, tmp_path / "x", "--max-size", "0"], 2, "must be at least 1 byte"),
        (["pack", photos, photos / "shards"], 1, "the destination is inside the source"),
    ]:
        result = run(*args)
        assert result.exit_code == code, (args, result.output)
        assert text in result.output and "Traceback" not in result.output, (args, result.output)
        assert len(result.output.strip().splitlines()) == 1 or code == 2, result.output


def test_verify_an_lmdb(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "photos.lmdb"
    assert run("pack", photos, out, "--format", "lmdb", "-q").exit_code == 0
    result = run("verify", out)
    assert result.exit_code == 0 and "BAD" not in result.output, result.output
    import lmdb

    from shardkit.formats import lmdb as lmdb_format

    def edit(**puts: bytes) -> None:
        lmdb_format.close_reader(str(out))  # verify's reader: one environment per file and process
        env = lmdb.open(str(out))
        with env.begin(write=True) as txn:
            for k, v in puts.items():
                txn.put(k.encode(), v) if v else txn.delete(k.encode())
        env.close()

    key = json.loads((out / "index.json").read_text())["keys"][3]
    edit(**{f"{key}.jpg": b"short"})
    result = run("verify", out)
    assert result.exit_code == 1 and f"sample {key}: 5" in result.output and "index says" in result.output
    edit(**{f"{key}.{ext}": b"" for ext in ("cls", "jpg", "json")})
    result = run("verify", out)
    assert result.exit_code == 1 and f"sample {key} is missing" in result.output
    shardkit.pack(str(photos), str(tmp_path / "fresh.lmdb"), format="lmdb", progress=False)
    out = tmp_path / "fresh.lmdb"
    edit(**{"stray.jpg": b"x"})
    result = run("verify", out)
    assert result.exit_code == 1 and "1 stray record(s)" in result.output
    with open(out / "data.mdb", "r+b") as f:  # pages zeroed: LMDB aborts the process walking them
        f.seek(4 * 4096)
        f.write(bytes(10 * 4096))
    result = run("verify", out)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert f"BAD  {out}: data.mdb is corrupt (reading its records crashed LMDB: SIGABRT: " in result.output


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_verify_decode_names_images_that_do_not_decode(
    run,
    photos: Path,
    tmp_path: Path,
    fmt: str,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A broken data stream between intact ends passes the byte checks (the shard is as
    packed); --decode names the sample, every image once whatever RANK and WORLD_SIZE say."""
    import io

    import numpy as np
    from PIL import Image

    out = tmp_path / "out"
    shardkit.pack(str(photos), str(out), format=fmt, workers=1, progress=False)
    assert run("verify", out, "--decode", "--workers", "0").output.endswith("every image decodes\n")
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    data[data.index(b"IDAT") + 200] ^= 0xFF
    (photos / "circle" / "damaged.png").write_bytes(bytes(data))
    shardkit.pack(str(photos), str(out), format=fmt, workers=1, progress=False, overwrite=True)
    monkeypatch.setenv("WORLD_SIZE", "2")  # a shell inside a job: this rank's share would miss the image
    monkeypatch.setenv("RANK", "1")
    assert run("verify", out, "--workers", "2").exit_code == 2  # --workers goes with --decode
    result = run("verify", out, "--decode", "--workers", "2")
    assert result.exit_code == 1, result.output
    bad = [line for line in result.output.splitlines() if line.startswith("BAD  ")]
    assert len(bad) == 1 and re.search(
        r"sample '\d+' \(packed from circle/damaged\.png\): field 'png': cannot decode "
        "image",
        bad[0],
    ), result.output
    assert result.output.endswith(
        f"images that do not decode in {out}: 1 (readers leave them out with "
        'on_error="skip", bench and preview with --on-error skip; `shardkit pack '
        "--decode-check` keeps them out of a pack)\n"
    )


def test_index_command_for_foreign_shards(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import webdataset as wds

    (tmp_path / "wds").mkdir()
    with wds.ShardWriter(str(tmp_path / "wds" / "part-%06d.tar"), maxcount=3, verbose=0) as sink:
        for i in range(7):
            sink.write({"__key__": f"k{i}", "jpg": b"x" * 10, "cls": b"1"})
    result = run("index", tmp_path / "wds")
    assert result.exit_code == 0 and "indexed 7 samples in 3 shards" in result.output
    assert run("index", tmp_path / "wds").exit_code == 1  # exists: needs --force
    assert run("verify", tmp_path / "wds", "-q").exit_code == 0


def test_index_force_on_a_pack_keeps_what_the_shards_cannot_tell(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (photos / "circle" / "notes.txt").write_text("not an image")
    out = tmp_path / "out"
    shardkit.pack(str(photos), str(out), max_count=10, workers=1, progress=False)
    before = shardkit.index.load(str(out))
    assert run("index", out, "--force").exit_code == 0
    after = shardkit.index.load(str(out))
    assert after.classes == before.classes == tuple(CLASSES) and after.skipped == before.skipped != ()
    assert after.shards == before.shards and after.plan is None  # a pack's rerun no longer takes it for its own


def test_index_upgrade_writes_version_2_from_version_1_reading_no_shard(
    run,
    packed_v1: Path,
    packed: Path,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    """The upgrade takes the offsets from index.json alone (no shard here), keeps a shard
    entry's fields it does not know, and writes what a pack writes."""
    out = tmp_path / "v1"
    out.mkdir()
    doc = json.loads((packed_v1 / "index.json").read_text())
    doc["shards"][1]["version"] = {"etag": "abc"}  # a field of another shardkit
    (out / "index.json").write_text(json.dumps(doc))
    assert run("index", out, "--upgrade", "--force").exit_code == 2
    result = run("index", out, "--upgrade")
    assert result.exit_code == 0, result.output
    side = shardkit.index.load(str(packed)).offsets_file.file
    assert result.output == f"upgraded index.json to version 2: the offsets of 120 samples are in {side}\n"
    assert (out / side).read_bytes() == (packed / side).read_bytes()
    new = json.loads((out / "index.json").read_text())
    assert new["version"] == 2 and new["shards"][1]["version"] == {"etag": "abc"}
    assert all("offsets" not in s for s in new["shards"])
    assert run("index", out, "--upgrade").output == "index.json is of version 2 already: nothing to upgrade\n"
    (out / side).unlink()  # `info` reads index.json only, whatever the size
    assert "samples:  120" in run("info", out).output


def test_cli_and_packer_do_not_import_torch() -> None:
    code = "import sys, shardkit.cli, shardkit.packing.pack; print(sorted(m for m in ('torch', 'lmdb') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_public_names_sorted_and_importable() -> None:
    assert shardkit.__all__ == sorted(shardkit.__all__)
    for name in shardkit.__all__:
        assert getattr(shardkit, name) is not None


def test_cli_reference_page_is_current() -> None:
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    page = (ROOT / "docs" / "cli.md").read_text()
    assert module.rendered(page) == page, "docs/cli.md is stale: run scripts/cli_reference.py"


def _stderr_on_a_terminal(*args: str) -> str:
    """Run `shardkit ARGS` with stderr on a pseudo-terminal; what it wrote there."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty has 0 columns
    subprocess.run(
        [sys.executable, "-m", "shardkit.cli", *args],
        stderr=follower,
        stdout=subprocess.DEVNULL,
        check=True,
        timeout=120,
    )
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # EIO: nothing more on a closed pty
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    return out.decode("utf-8", "replace")


def test_progress_bar_on_a_terminal_only(photos: Path, tmp_path: Path) -> None:
    bar = _stderr_on_a_terminal("pack", str(photos), str(tmp_path / "a"), "--workers", "1")
    assert "pack:" in bar and "30/30" in bar and "img" in bar
    assert _stderr_on_a_terminal("pack", str(photos), str(tmp_path / "b"), "--workers", "1", "-q") == ""
    piped = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "pack", str(photos), str(tmp_path / "c"), "--workers", "1"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "img" not in piped.stderr  # not a terminal: no bar


def test_python_dash_m_runs_the_command() -> None:
    done = subprocess.run([sys.executable, "-m", "shardkit", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("Usage: shardkit [OPTIONS] COMMAND")


def test_rerun_and_overwrite(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    assert run("pack", photos, out, "--max-count", "8").exit_code == 0
    again = run("pack", photos, out, "--max-count", "8")
    assert again.exit_code == 0 and f"{out}: already holds this pack (30 samples in 4 shards" in again.output
    other = run("pack", photos, out, "--max-count", "16")
    assert other.exit_code == 1 and "already holds a different dataset (30 samples" in other.output
    assert len(list(out.glob("*.tar"))) == 4
    replaced = run("pack", photos, out, "--max-count", "16", "--overwrite")
    assert replaced.exit_code == 0 and "packed 30 samples into 2 shards" in replaced.output


def test_quiet_still_names_unusable_files(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (photos / "circle" / ".DS_Store").write_bytes(b"x")
    assert run("pack", photos, tmp_path / "a", "-q").output == ""  # hidden entries are not unusable files
    (photos / "circle" / "bad.jpg").write_bytes(b"nope")
    result = run("pack", photos, tmp_path / "b", "-q")
    assert (
        result.exit_code == 0
        and result.output == f"skipped 1 unusable file (shardkit info {tmp_path / 'b'} lists them)\n"
    )


def test_a_file_name_with_a_newline_is_listed_on_one_line(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (photos / "circle" / "bad\nname.jpg").write_bytes(b"nope")
    packed = run("pack", photos, tmp_path / "out")
    listed = run("info", tmp_path / "out")
    for result in (packed, listed):
        assert "  circle/bad\\nname.jpg: not an image file\n" in result.output, result.output


@pytest.mark.parametrize(
    "setup, args, text",
    [
        (lambda t: (t / "x.txt").write_text("x"), ["{photos}", "{t}/x.txt"], "x.txt: a file, not a folder"),
        (lambda t: None, ["{photos}", "/dev/null"], "/dev/null: a file, not a folder"),
        (
            lambda t: (t / "db").mkdir() or (t / "db" / "data.mdb").write_bytes(b"x"),
            ["{photos}", "{t}/db"],
            "db: holds an LMDB dataset: pack tar shards into another folder",
        ),
        (
            lambda t: (t / "wds").mkdir() or (t / "wds" / "a-000.tar").write_bytes(b""),
            ["{t}/wds", "{t}/out"],
            "wds: no class folders (expected SRC/<class>/<image>; images without classes: --layout flat); tar shards from "
            "another tool are converted once `shardkit index",
        ),
    ],
)
def test_pack_errors_say_what_to_do(run, photos: Path, tmp_path: Path, setup, args: list[str], text: str) -> None:  # type: ignore[no-untyped-def]
    setup(tmp_path)
    result = run("pack", *[a.format(photos=photos, t=tmp_path) for a in args])
    assert result.exit_code == 1 and text in result.output and result.output.count("\n") == 1


def test_an_os_error_is_one_line_without_what_a_url_would_hide(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "a?token=secret").write_text("a file, not a folder")
    result = run("pack", photos, tmp_path / "a?token=secret" / "out", "-q")
    assert result.exit_code == 1 and "Not a directory" in result.output and result.output.count("\n") == 1
    assert "secret" not in result.output


def test_ray_address_needs_the_ray_executor(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    result = run("pack", photos, tmp_path / "out", "--ray-address", "auto")
    assert result.exit_code == 2 and "--ray-address needs --executor ray" in result.output


def test_an_unfinished_pack_is_not_read_as_a_dataset(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """What a killed pack leaves (finished shards, its progress records, no index.json) is
    refused by every reader, by `index` and as a pack's source: never read as foreign shards."""
    from shardkit import LMDBDataset, StreamingDataset, UnfinishedPackError

    out = tmp_path / "out"
    run("pack", photos, out, "--max-count", "8", "-q")
    (out / "index.json").unlink()
    (out / ".shardkit-progress").mkdir()
    said = "index.json: not written yet: a pack into"
    for args in (
        ("info", out),
        ("verify", out),
        ("index", out),
        ("pack", out, tmp_path / "copy"),
        ("preview", out, "--out", tmp_path / "p.png"),
    ):
        result = run(*args)
        assert result.exit_code == 1 and said in result.output, (args, result.output)
        assert "rerun the same `shardkit pack` to finish it" in result.output and result.output.count("\n") == 1
    assert not (out / "index.json").exists() and not (tmp_path / "copy").exists()
    with pytest.raises(UnfinishedPackError, match=said):
        StreamingDataset(str(out))
    run("pack", photos, out, "--max-count", "8", "-q")  # the rerun finishes it
    assert len(StreamingDataset(str(out))) == 30
    lmdb = tmp_path / "db"
    run("pack", photos, lmdb, "--format", "lmdb", "-q")
    (lmdb / "index.json").unlink()
    result = run("info", lmdb)
    assert (
        result.exit_code == 1 and "an LMDB pack that has not finished, or whose index.json was removed" in result.output
    )
    assert len(LMDBDataset(str(lmdb))) == 30  # the copy of the index inside the LMDB serves the readers


def test_folders_that_are_not_datasets_say_what_they_may_be(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from shardkit import DatasetNotFoundError, StreamingDataset

    wds = tmp_path / "wds"
    wds.mkdir()
    with tarfile.open(wds / "a-000.tar", "w") as tar:
        tar.add(photos / "circle" / "img_0000.jpg", "0.jpg")
    result = run("info", wds)
    assert result.exit_code == 1 and f"tar shards from another tool: `shardkit index {wds}` writes one" in result.output
    with pytest.raises(DatasetNotFoundError, match=r"no \.tar shards \(an image folder\? `shardkit pack` it first\)"):
        StreamingDataset(str(photos))
    assert run("index", wds).output.startswith("indexed 1 sample in 1 shard (")


def test_a_closed_pipe_ends_quietly(photos: Path, tmp_path: Path) -> None:
    """`shardkit info URL | head -1`: no 'Broken pipe' error when the reader stops early."""
    shardkit.pack(str(photos), str(tmp_path / "out"), max_count=1, workers=1, progress=False)
    proc = subprocess.run(
        f"'{sys.executable}' -m shardkit.cli info --json '{tmp_path / 'out'}' | head -c 10",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
        executable="/bin/bash",
    )
    assert proc.stdout == '{"format":' and proc.stderr == ""


def test_commands_that_need_torch_say_so_without_it(photos: Path, tmp_path: Path) -> None:
    """pack, info and verify run without PyTorch; bench and preview say in one line that they need it."""
    shardkit.pack(str(photos), str(tmp_path / "out"), workers=1, progress=False)
    block = "import sys; sys.modules['torch'] = None; from shardkit.cli import main; main()"
    for args, code in ((["info"], 0), (["verify", "-q"], 0), (["bench"], 1), (["preview"], 1)):
        proc = subprocess.run(
            [sys.executable, "-c", block, *args, str(tmp_path / "out")], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == code, proc.stderr
        if code:
            assert (
                proc.stderr == "Error: this command reads through PyTorch, which is not installed: pip install torch\n"
            )


def test_the_readers_say_to_install_torch_without_it() -> None:
    """`from shardkit import StreamingDataset` (or LMDBDataset, collate) without PyTorch: one
    line saying what to install, still a ModuleNotFoundError for `except ImportError`."""
    for name in ("StreamingDataset", "LMDBDataset", "collate"):
        code = (
            f"import sys; sys.modules['torch'] = None\ntry:\n    from shardkit import {name}\n"
            "except ModuleNotFoundError as e:\n    print(e.name, e)"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert (
            out == f"torch shardkit.{name} reads through PyTorch, which is not installed: pip install torch "
            "(the build you train with)\n"
        )


def test_verify_says_which_shards_it_could_not_hash(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    run("pack", photos, out, "--max-count", "8", "-q")
    doc = json.loads((out / "index.json").read_text())
    del doc["shards"][1]["sha256"]
    (out / "index.json").write_text(json.dumps(doc))
    result = run("verify", out)
    assert result.exit_code == 0
    assert "ok   shard-000001.tar (8 samples) (no sha256 in the index)" in result.output
    assert (
        "1 shard without a sha256 in the index: sizes, counts and offsets match, their bytes were not checked"
        in result.output
    )


def test_shards_whose_files_were_all_skipped_are_counted_as_empty(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "b").mkdir()
    for i in range(4):
        draw(src / "a" / f"{i}.jpg", 0, i)
        (src / "b" / f"{i}.jpg").write_bytes(b"\xff\xd8\xff\xe0 not the rest of a jpeg")  # passes the scan
    result = run("pack", src, tmp_path / "out", "--no-shuffle", "--max-count", "2")
    assert result.exit_code == 0
    assert "packed 4 samples into 4 shards (2 empty: every file in them was skipped)" in result.output
    assert "skipped 4 files:" in result.output


def test_max_size_below_a_tar_record_is_a_usage_error(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    result = run("pack", photos, tmp_path / "out", "--max-size", "100")
    assert result.exit_code == 2 and "'--max-size': at least 10KiB for tar shards" in result.output
    assert not (tmp_path / "out").exists()


def test_ctrl_c_exits_130(run, photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Not 1, the code of bad data: a script can tell an interruption from a refusal."""

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(sys.modules["shardkit.packing.pack"], "pack", interrupted)
    result = run("pack", photos, tmp_path / "out")
    assert result.exit_code == 130 and result.output.strip() == "interrupted"


_CTRL_C = """
import os, signal, sys, time
from shardkit import cli, interrupts

def ctrl_c_twice():
    caught = 0
    for _ in range(2):
        try:
            signal.raise_signal(signal.SIGINT)
            time.sleep(0.2)
        except KeyboardInterrupt:
            caught += 1
    return caught

mode = sys.argv[1]
if mode == "in-process":  # main() in a user's process leaves its Ctrl-C alone
    cli.main(["--help"], standalone_mode=False)
    sys.exit(ctrl_c_twice())
interrupts.exit_on_second_ctrl_c()
if mode == "forked":  # a DataLoader worker, say: Python's behaviour, the pack's message never
    pid = os.fork()
    if pid == 0:
        os._exit(ctrl_c_twice())
    sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
if mode == "no-stderr":  # `shardkit pack ... | tee log`: the first Ctrl-C ended tee
    os.close(2)
ctrl_c_twice()
sys.exit(3)
"""


@pytest.mark.parametrize(
    ("mode", "code", "said"),
    [
        ("twice", 130, "interrupted again: exiting now (a rerun of pack resumes)"),
        ("in-process", 2, ""),
        ("forked", 2, ""),
        ("no-stderr", 130, ""),
    ],
)
def test_a_second_ctrl_c_exits_at_once_in_the_command_only(tmp_path: Path, mode: str, code: int, said: str) -> None:
    """The `shardkit` command exits at a second Ctrl-C (tests/test_pack.py runs a stalled
    pack); main() called in a user's process and processes forked from the command raise
    KeyboardInterrupt each time, as Python does."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(_CTRL_C)
    # Ctrl-C at Python's default, as in a terminal's foreground job, whatever this suite was started
    # with (a background job `./scripts/test.sh &` ignores SIGINT, and its children inherit that)
    result = subprocess.run(
        [sys.executable, str(script), mode],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert (result.returncode, result.stderr.strip()) == (code, said)


def test_resize_is_refused_on_a_dataset_converted_byte_for_byte(run, packed: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    for option in (("--resize", "64"), ("--quality", "80")):
        result = run("pack", packed, tmp_path / "out", *option)
        assert result.exit_code == 1 and "converted byte for byte; resize and quality re-encode" in result.output
        assert str(packed) in result.output and not (tmp_path / "out").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/mem and RLIMIT_FSIZE")
def test_errors_about_the_machine_name_the_file(photos: Path, tmp_path: Path) -> None:
    """An I/O error reading a source file or writing a shard stops the pack (not skipped:
    it would hit every file after it) and names the file."""
    src = tmp_path / "src"
    subprocess.run(["cp", "-r", str(photos), str(src)], check=True)
    (src / "circle" / "eio.jpg").symlink_to("/proc/self/mem")  # reading it fails with EIO
    cmd = [sys.executable, "-m", "shardkit", "pack", str(src), str(tmp_path / "a"), "--workers", "1", "-q"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr == f"Error: {src}/circle/eio.jpg: Input/output error\n"

    limit = (
        "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000)); from shardkit.cli import main; main()"
    )
    cmd = [sys.executable, "-c", limit, "pack", str(photos), str(tmp_path / "b"), "--workers", "1", "-q"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr == f"Error: {tmp_path}/b/shard-000000.tar: File too large\n"
