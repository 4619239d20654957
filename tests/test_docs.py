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
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # a banner about MkDocs 2
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "api" / "index.html").read_text().count("StreamingDataset") > 3


def test_readme_first_loader_collates_as_written(in_packed_folder: Path) -> None:
    scope: dict = {}
    exec(snippet("readme-first-loader"), scope)
    assert tuple(scope["images"].shape) == (4, 3, 40, 48) and len(scope["labels"]) == 4


def _as_a_user() -> dict[str, str]:
    """A shell's environment with this checkout's `python` and `shardkit` first on PATH."""
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
    }


def _shell(script: str, cwd: Path, timeout: float = 120) -> str:
    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_as_a_user(),
    )
    assert run.returncode == 0, f"{script}\nexited with {run.returncode}:\n{run.stdout}\n{run.stderr}"
    return run.stdout


@pytest.mark.timeout(180)
def test_readme_quickstart_runs_as_written_on_its_sample_images(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newcomer with no image folder: the Quickstart's commands, then its two loaders, unchanged."""
    section = README.split("## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    commands = re.search(r"^((?:    .*\n)+)", section, re.M)  # its first indented block
    assert commands and commands[1].lstrip().startswith("python -m shardkit.tools.sample_images ./photos")
    out = _shell(commands[1], tmp_path)
    assert "120 images in 3 classes under ./photos" in out and "packed 120 samples" in out, out
    assert "classes:  3 (circle, square, triangle)" in out and "all shards match the index" in out, out
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(snippet("readme-first-loader"), scope)
    assert tuple(scope["images"].shape) == (4, 3, 240, 320) and set(scope["batch"]["__ext__"]) <= {"jpg", "png", "webp"}
    exec(snippet("readme-quickstart"), scope)
    assert tuple(scope["images"].shape[1:]) == (3, 224, 224)


def test_sample_images_are_the_same_bytes_every_time_and_refuse_a_used_folder(tmp_path: Path) -> None:
    from shardkit.tools import sample_images

    first = sample_images.write(tmp_path / "a", per_class=5, size=(64, 48))
    again = sample_images.write(tmp_path / "b", per_class=5, size=(64, 48))
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in again]
    assert {p.suffix for p in first} == {".jpg", ".png", ".webp"} and len({p.parent.name for p in first}) == 3
    assert sample_images.write(tmp_path / "a", per_class=5, size=(64, 48)) == first  # a rerun rewrites its own
    (tmp_path / "a" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"a: holds files this did not write .*notes.txt"):
        sample_images.write(tmp_path / "a", per_class=5)


def _guide_block(text: str, tag: str, lang: str) -> str:
    found = re.search(rf"<!-- {tag} -->\n```{lang}\n(.*?)```", text, re.S)
    assert found, f"no {lang} block tagged {tag}"
    return found[1]


@pytest.mark.timeout(180)
def test_try_s3_locally_runs_as_written(tmp_path: Path) -> None:
    """docs/guides/try-s3.md, its blocks in order in one shell, on a free port for 9000: a real
    moto server, `shardkit pack` into it, StreamingDataset reading it back; its install line
    names only what pyproject.toml declares."""
    import tomllib

    from servers import free_port

    guide = (ROOT / "docs" / "guides" / "try-s3.md").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {
        re.split(r"[\[<>=!~; ]", d, maxsplit=1)[0] for deps in project["optional-dependencies"].values() for d in deps
    }
    for word in _guide_block(guide, "try-s3-install", "bash").split()[2:]:
        extra = re.fullmatch(r"'\.\[(\w+)\]'", word)
        assert (extra[1] in project["optional-dependencies"]) if extra else word.strip("'").split("[")[0] in declared
    script = "\n".join(
        [
            "trap 'kill ${MOTO_PID:-} 2>/dev/null || true' EXIT",  # the server goes, whatever fails
            _guide_block(guide, "try-s3-serve", "bash"),
            "python - <<'PYTHON'\n" + _guide_block(guide, "try-s3-read", "python") + "PYTHON",
            _guide_block(guide, "try-s3-stop", "bash"),
        ]
    )
    assert script.count("9000") >= 4
    out = _shell(script.replace("9000", str(free_port())), tmp_path)
    assert re.search(r"packed 120 samples into [2-9] shards", out), out
    assert "samples:  120" in out and "120 samples; images (8, 3, 240, 320)" in out, out
    assert "# 120 samples; images (8, 3, 240, 320)" in guide  # what the guide says it prints


def test_readme_peers_table_and_chart_show_docs_peers_json() -> None:
    """The README's "How it compares" table is the one bench/peers_chart.py renders from
    docs/peers.json, and docs/peers.png was drawn from that same file."""
    from PIL import Image

    from bench import peers_chart

    summary = peers_chart.load(ROOT / "docs" / "peers.json")
    assert peers_chart.table(summary) in README
    assert f"`{summary['command']}`, {summary['date']}" in README
    assert f"no loader: {peers_chart.spread(summary['decode_limit'])}" in README
    with Image.open(ROOT / "docs" / "peers.png") as png:
        drawn_from = png.text.get(peers_chart.DIGEST_KEY)
    assert drawn_from == peers_chart.digest(ROOT / "docs" / "peers.json"), (
        "docs/peers.png is not drawn from docs/peers.json: python -m bench.peers_chart docs/peers.json docs/peers.png"
    )


def test_the_peers_chart_has_a_bar_for_each_readme_row_and_no_other(tmp_path: Path) -> None:
    from bench import peers_chart

    table = README.split(peers_chart.HEADER, 1)[1].split("\n\n", 1)[0]
    rows = [[c.strip().strip("*").replace("`", "") for c in line.strip("|").split("|")] for line in table.splitlines()]
    expected = [(cells[0], float(cells[2].split()[0].replace(",", ""))) for cells in rows]
    drawn = peers_chart.draw(peers_chart.load(ROOT / "docs" / "peers.json"), tmp_path / "peers.png", "x")
    assert drawn == expected and len(drawn) == 6


def _install_block() -> list[str]:
    """The command lines of the README's first indented block under ## Install."""
    section = README.split("## Install\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"\n\n((?:    .*\n)+)", section)
    assert block, "README's Install section has no command block"
    return [line.split("#")[0].strip() for line in block[1].splitlines()]


def test_readme_first_screen_installs_torch_for_cpu_and_cuda_before_shardkit() -> None:
    """As PyTorch's selector gives them (pip, Linux): the CPU wheel index, PyPI's default CUDA build."""
    import tomllib

    lines = _install_block()
    assert README.index("## Install") < 1500  # the first screen
    assert lines[:2] == ["pip install torch --index-url https://download.pytorch.org/whl/cpu", "pip install torch"]
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for line in lines[2:]:
        found = re.fullmatch(r"pip install '\.\[([\w,]+)\]'", line)
        assert found and set(found[1].split(",")) <= extras, line
    assert "not on PyPI yet: install it from a checkout" in README
    said = re.search(r"extras: ([\w, ]+)", README)
    assert said and set(said[1].split(", ")) == extras - {"test"}, "the README lists the extras pyproject.toml has"


def _imports(code: str) -> set[str]:
    import ast

    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"shardkit", "train_local", "make_images", "__future__"}


def test_the_examples_extra_brings_what_the_examples_and_readme_import() -> None:
    """`pip install '.[examples]'` is all an example or README snippet needs beyond shardkit."""
    import importlib.metadata
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {
        re.split(r"[\[<>=!~; ]", d, maxsplit=1)[0].lower()
        for d in [*project["dependencies"], *project["optional-dependencies"]["examples"]]
    }
    code = [p.read_text() for p in (ROOT / "examples").glob("*.py")] + [
        (ROOT / "scripts" / "make_images.py").read_text()
    ]
    code += re.findall(r"```python\n(.*?)```", README, re.S)
    modules = set().union(*map(_imports, code))
    dists = importlib.metadata.packages_distributions()
    needed = {dist.lower() for m in modules for dist in dists.get(m, [m])}
    assert {"torch", "torchdata", "numpy", "pillow"} <= needed
    assert needed <= declared, f"imported by an example or the README, not in the examples extra: {needed - declared}"
    assert "scikit-image" in declared and "s3fs" in declared  # the tour's photos, train_s3.py's bucket


def test_readme_wheel_line_builds_the_wheel_it_names(tmp_path: Path) -> None:
    """`pip wheel --no-deps -w dist .` (without build isolation: no registry here), from a copy
    of the checkout, gives the file the README installs; `python -m build` is said to need `build`."""
    import shutil

    line = re.search(r"`(pip wheel --no-deps -w dist \.)`", README)
    assert line and "`python -m build` needs `pip install build`" in README
    src = tmp_path / "src"
    shutil.copytree(ROOT / "shardkit", src / "shardkit", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src)
    args = line[1].split()[2:]  # --no-deps -w dist .
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", *args],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert [p.name for p in (src / "dist").iterdir()] == ["shardkit-0.1.0-py3-none-any.whl"]
    install = (ROOT / "docs" / "install.md").read_text()
    assert "dist/shardkit-0.1.0-py3-none-any.whl" in install and "pip install build" in install
