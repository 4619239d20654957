"""The code base stays free of unused imports and names, likely bugs (bugbear) and style drift."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_code_is_laid_out_by_ruff_format() -> None:
    """One layout, ruff's at 120 columns (pyproject.toml): `ruff format .` makes it so."""
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--no-cache", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_mypy_strict_finds_nothing(pytestconfig: pytest.Config, tmp_path: Path) -> None:
    """The package is checked strictly (settings in pyproject.toml); each `type: ignore` says why.
    Its cache lives in pytest's (.pytest_cache/d/mypy): a rerun checks only what changed, 2 s
    against 12-50 s on 2 cores; without pytest's cache (-p no:cacheprovider) it starts afresh."""
    cache = getattr(pytestconfig, "cache", None)
    folder = cache.mkdir("mypy") if cache is not None else tmp_path
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(folder)], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
