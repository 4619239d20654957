"""One `on_error` vocabulary, "raise" | "skip", for the packer and the readers, in Python and
on the command line; the packer's old "fail" still works, as "raise", with a warning."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import shardkit
from shardkit.cli import main
from shardkit.errors import CorruptShardError, SourceError
from shardkit.reading.dataset import StreamingDataset

OLD = r'on_error="fail" is deprecated: use on_error="raise"'
CLI_OLD = "Warning: --on-error fail is deprecated: use --on-error raise"


def _broken(photos: Path, tmp_path: Path) -> tuple[Path, str]:
    """A packed dataset with one sample's JPEG overwritten: (dataset, shard name)."""
    from readers import break_image

    dataset = tmp_path / "shards"
    shardkit.pack(str(photos), str(dataset), max_count=10, workers=1, progress=False)
    shard, _ = break_image(dataset, 1, 2)
    return dataset, shard


def test_pack_takes_fail_as_raise_with_a_deprecation_warning(photos: Path, tmp_path: Path) -> None:
    (photos / "square" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0garbage")
    with (
        pytest.warns(DeprecationWarning, match=OLD) as caught,
        pytest.raises(SourceError, match=r"square/broken\.jpg: "),
    ):
        shardkit.pack(str(photos), str(tmp_path / "out"), on_error="fail", workers=1, progress=False)
    assert [w.filename for w in caught] == [__file__]  # the warning points at the caller's line
    assert not (tmp_path / "out" / "index.json").exists()


def test_the_readers_take_fail_as_raise_too(photos: Path, tmp_path: Path) -> None:
    dataset, shard = _broken(photos, tmp_path)
    with pytest.warns(DeprecationWarning, match=OLD) as caught:
        ds = StreamingDataset(str(dataset), decode="rgb8", on_error="fail")
    assert ds.on_error == "raise" and [w.filename for w in caught] == [__file__]
    with pytest.raises(CorruptShardError, match=shard):
        list(ds)
    assert len(list(StreamingDataset(str(dataset), decode="rgb8", on_error="skip"))) == len(ds)  # a stand-in for it


@pytest.mark.parametrize("value", ["stop", "Raise", None, 1])
@pytest.mark.parametrize("half", ["pack", "read"])
def test_a_wrong_value_is_one_line_naming_the_choices(photos: Path, tmp_path: Path, half: str, value: object) -> None:
    with pytest.raises(ValueError) as e:
        if half == "pack":
            shardkit.pack(str(photos), str(tmp_path / "out"), on_error=value, progress=False)  # type: ignore[arg-type]
        else:
            StreamingDataset(str(photos), on_error=value)  # type: ignore[arg-type]
    assert str(e.value) == f"on_error must be 'raise' or 'skip', not {value!r}"
    assert not (tmp_path / "out").exists()


def test_the_cli_takes_fail_as_raise_with_a_warning(photos: Path, tmp_path: Path) -> None:
    (photos / "square" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0garbage")
    result = CliRunner().invoke(main, ["pack", str(photos), str(tmp_path / "out"), "--on-error", "fail", "-q"])
    lines = result.output.splitlines()
    assert result.exit_code == 1 and len(lines) == 2 and lines[0] == CLI_OLD, result.output
    assert "square/broken.jpg: " in lines[1] and "(--on-error raise; remove the file" in lines[1], result.output
    assert not (tmp_path / "out" / "index.json").exists()


def test_bench_and_preview_take_fail_as_raise_with_a_warning(photos: Path, tmp_path: Path) -> None:
    dataset, shard = _broken(photos, tmp_path)
    for command in (
        ["preview", str(dataset), "--n", "30", "--out", str(tmp_path / "all.png")],
        [
            "bench",
            str(dataset),
            "--workers",
            "0",
            "--batch-size",
            "10",
            "--batches",
            "3",
            "--passes",
            "1",
            "--warmup",
            "1",
        ],
    ):
        result = CliRunner().invoke(main, [*command, "--on-error", "fail"])
        lines = result.output.splitlines()
        assert result.exit_code == 1 and lines[0] == CLI_OLD and lines[-1].startswith("Error: "), result.output
        assert shard in lines[-1] and "--on-error skip leaves bad samples out" in lines[-1], result.output


@pytest.mark.parametrize("command", ["pack", "bench", "preview"])
def test_the_cli_names_the_choices_of_a_wrong_value(photos: Path, tmp_path: Path, command: str) -> None:
    args = [str(photos), str(tmp_path / "out")] if command == "pack" else [str(photos)]
    result = CliRunner().invoke(main, [command, *args, "--on-error", "stop"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--on-error': 'stop' is not one of 'raise', 'skip'." in result.output
    assert CLI_OLD not in result.output
