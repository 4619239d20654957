"""The package as a user gets it: a wheel and an sdist built by `python -m build`, and the
wheel installed with its own dependencies alone (no extras, so no PyTorch) in a fresh venv."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT


def run(args: list[str | Path]) -> subprocess.CompletedProcess[str]:
    """A command away from this checkout's code: no PYTHONPATH leading back to it, and not
    started in it (`python -c` imports from its working directory first)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, env=env, timeout=240, cwd=Path(args[0]).anchor
    )


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"{proc.args} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.timeout(300)
def test_the_wheel_installs_and_runs_without_extras(photos: Path, tmp_path: Path) -> None:
    """45-60 s on a busy 2-core machine: the build's two isolated environments (setuptools from
    the registry), then the wheel's dependencies. The venv is made without pip and filled by
    this environment's pip (`--python`): ensurepip alone took 20 s."""
    dist = tmp_path / "dist"
    ok(run([sys.executable, "-m", "build", "--outdir", dist, ROOT]))  # the wheel is built from the sdist
    (sdist,), (wheel,) = dist.glob("*.tar.gz"), dist.glob("*.whl")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "shardkit/py.typed"} <= names
    assert not any(n.startswith("tests/") for n in names)
    with zipfile.ZipFile(wheel) as whl:
        metadata = whl.read("shardkit-0.1.0.dist-info/METADATA").decode()
        assert {"shardkit/py.typed", "shardkit-0.1.0.dist-info/licenses/LICENSE"} <= set(whl.namelist())
    assert "License-Expression: Apache-2.0" in metadata
    core = [line.split()[1] for line in metadata.splitlines() if line.startswith("Requires-Dist:") and ";" not in line]
    assert not [name for name in core if name.startswith("torch")], core
    assert 'Requires-Dist: torch>=2.1; extra == "bench"' in metadata

    venv = tmp_path / "venv"
    ok(run([sys.executable, "-m", "venv", "--without-pip", venv]))
    python, shardkit = venv / "bin" / "python", venv / "bin" / "shardkit"
    ok(run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-compile", wheel]))

    where = ok(run([python, "-c", "import sys, shardkit; print(shardkit.__file__, 'torch' in sys.modules)"]))
    assert where.split() == [
        str(
            venv
            / "lib"
            / f"python{sys.version_info[0]}.{sys.version_info[1]}"
            / "site-packages"
            / "shardkit"
            / "__init__.py"
        ),
        "False",
    ]
    assert ok(run([shardkit, "--version"])).split()[-1] == "0.1.0"
    out = tmp_path / "shards"
    assert "packed 30 samples into 1 shard" in ok(run([shardkit, "pack", photos, out]))
    assert "samples:  30" in ok(run([shardkit, "info", out]))
    assert "all shards match the index" in ok(run([shardkit, "verify", out]))
    proc = run([python, "-c", "from shardkit import StreamingDataset"])
    assert proc.returncode == 1 and "pip install torch" in proc.stderr


def _declared() -> tuple[set[str], set[str]]:
    """(every distribution pyproject.toml names, normalised; its extras)."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    specs = [*project["dependencies"], *(d for deps in extras.values() for d in deps)]
    return {re.split(r"[\[<>=!~; ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in specs}, set(extras)


def _hints(path: Path) -> list[str]:
    """What each `pip install ...` in a string of `path` installs (the word after it)."""
    import ast
    import re

    texts = [
        n.value
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]
    return [m[1] for text in texts for m in re.finditer(r"pip install (?:-e )?(\S+)", text)]


HINTED = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "shardkit").rglob("*.py") if _hints(p))


@pytest.mark.parametrize("path", HINTED)
def test_install_hints_name_what_installs_from_a_checkout(path: str) -> None:
    """shardkit is not on PyPI: `pip install 'shardkit[gcs]'` finds nothing. A hint names a
    package that pyproject.toml depends on (`pip install gcsfs`), or a checkout's extra (`'.[gcs]'`)."""
    import re

    names, extras = _declared()
    for hint in _hints(ROOT / path):
        word = hint.strip("'\"`,;()")
        extra = re.fullmatch(r"\.\[(\w+)\]", word)
        if extra:
            assert extra[1] in extras, f"{path}: {hint}: no such extra"
        else:
            assert word.lower() in names | {"pyarrow"}, f"{path}: `pip install {hint}` names nothing pyproject.toml has"
    assert {"shardkit/cli/options.py", "shardkit/packing/executors.py", "shardkit/storage/clients.py"} <= set(HINTED)


@pytest.mark.parametrize(
    ("url", "hint"), [("s3://bucket/ds", "pip install s3fs"), ("gs://bucket/ds", "pip install gcsfs")]
)
def test_a_missing_backend_names_the_package_to_install(url: str, hint: str) -> None:
    """As a user without the extra sees it: the backend's import fails, the message names a
    package the registry has (not 'shardkit[s3]', which is not on it)."""
    backend = hint.split()[-1]
    code = (
        f"import sys; sys.modules[{backend!r}] = None\n"  # as if not installed
        "from shardkit.storage.clients import filesystem\n"
        f"filesystem({url!r})"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1].endswith(f"{url}: {url[:2]}:// support is not installed ({hint})"), proc.stderr
