"""The suite's scheduling in conftest.py names real tests: a renamed test would silently lose
its early start (and might start last, alone), a renamed file its single worker."""

from __future__ import annotations

from conftest import ROOT, SLOW_FIRST, TOGETHER


def test_slow_first_names_tests_that_exist() -> None:
    for prefix in SLOW_FIRST:
        file, _, name = prefix.partition("::")
        path = ROOT / file
        assert path.is_file(), f"SLOW_FIRST: {prefix}: no such file"
        assert not name or f"def {name}" in path.read_text(), f"SLOW_FIRST: {prefix}: no such test"


def test_files_kept_together_exist() -> None:
    assert TOGETHER and all((ROOT / file).is_file() for file in TOGETHER), TOGETHER
