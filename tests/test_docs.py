"""The README and the docs site: the code the README shows runs as shown, its links lead
somewhere, and the MkDocs site builds with no broken link or reference."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

import shardkit

README = (ROOT / "README.md").read_text()


def snippet(tag: str) -> str:
    """The Python block after `<!-- tag -->` in the README."""
    found = re.search(rf"<!-- {tag} -->\n```python\n(.*?)```", README, re.S)
    assert found, f"README has no block tagged {tag}"
    return found.group(1)


@pytest.fixture
def in_packed_folder(photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """cwd holding ./photos-shards, packed from the generated photos, as the README assumes."""
    shardkit.pack(str(photos), str(tmp_path / "photos-shards"), max_count=8, workers=1, progress=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_readme_quickstart_runs(in_packed_folder: Path) -> None:
    scope: dict = {}
    exec(snippet("readme-quickstart"), scope)
    assert scope["images"].dtype.is_floating_point is False and len(scope["labels"]) >= 1


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata calls an API torch deprecated
def test_readme_resume_with_stateful_dataloader_runs(in_packed_folder: Path) -> None:
    scope: dict = {}
    exec(snippet("readme-resume-stateful"), scope)
    before = 2 * 8  # two batches of eight before the state was saved
    assert sum(len(b["__key__"]) for b in scope["rest"]) == 30 - before


def test_readme_resume_with_plain_dataloader_runs(in_packed_folder: Path) -> None:
    scope: dict = {}
    exec(snippet("readme-resume-plain"), scope)
    assert sum(len(b["__key__"]) for b in scope["rest"]) == 30 - 16


def test_readme_links_lead_somewhere() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_readme_stays_the_front_door() -> None:
    assert len(README.splitlines()) <= 300


def test_docs_site_builds_strict(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # a banner about MkDocs 2
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "api" / "index.html").read_text().count("StreamingDataset") > 3
