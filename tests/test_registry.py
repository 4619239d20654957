"""Formats are chosen only through their registries: formats/ (a Format per name), the
packer's sinks (packing/sinks/) and the reader's sample sources (reading/sources/).
Nothing else branches on a format's name, so adding a format touches those only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "shardkit"
NAMES = {"tar", "lmdb", "tar.gz"}  # the formats' names (and the compressed tar's; a shard's compression is no format)

# where a format's name may be compared or keyed: the formats, the sinks and the sources
ALLOWED = {
    "formats/__init__.py",
    "formats/tar.py",
    "formats/gzip.py",
    "formats/lmdb.py",
    "formats/lmdb_envs.py",
    "packing/sinks/__init__.py",
    "packing/sinks/tar.py",
    "packing/sinks/lmdb.py",
    "reading/sources/__init__.py",
    "reading/sources/compressed.py",
    "reading/sources/tar.py",
    "reading/sources/lmdb.py",
    "index/resolve.py",
}


def _named(node: ast.AST) -> bool:
    """A string constant that is a format's name, alone or in a tuple/list/set literal."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in NAMES
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(map(_named, node.elts))


def branches(source: str) -> list[int]:
    """The lines of `source` that compare a format's name (==, !=, in, not in), match on it
    or key a dict literal with it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(
            isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops
        ):
            if any(map(_named, [node.left, *node.comparators])):
                found.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and _named(node.value):
            found.append(node.lineno)
        elif isinstance(node, ast.Dict) and any(k is not None and _named(k) for k in node.keys):
            found.append(node.lineno)
    return found


def test_the_check_finds_each_kind_of_branch() -> None:
    code = (
        'a == "tar"\n"lmdb" != b\nc in ("x", "tar.gz")\n{"tar": 1}\n'
        'match d:\n    case "lmdb":\n        pass\n'
        'e == "folder"\nf = "tar"\ng("lmdb")\n'
    )
    assert branches(code) == [1, 2, 3, 4, 6]


MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_no_branch_on_a_format_name_outside_the_registries(path: Path) -> None:
    name = path.relative_to(PACKAGE).as_posix()
    if name in ALLOWED:
        return
    lines = branches(path.read_text())
    assert not lines, (
        f"{name}:{lines[0]} branches on a format's name: ask shardkit.formats.get(name) (a Format's "
        "traits), packing/sinks/ or reading/sources/'s SOURCES instead"
    )


def test_every_allowed_module_exists() -> None:
    assert {n for n in ALLOWED if not (PACKAGE / n).is_file()} == set()


def test_a_format_registered_in_both_registries_packs_and_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new format (here tar shards under another name) needs a Format, a sink and a source:
    with those registered, pack writes it, the index names it and StreamingDataset reads it."""
    from conftest import make_folder

    import shardkit
    from shardkit import formats
    from shardkit.packing import sinks
    from shardkit.packing.sinks.tar import TarSink
    from shardkit.reading import sources

    class TwinSink(TarSink):
        name = "twin"

    class TwinSamples(sources.TarSamples):
        format = "twin"

    monkeypatch.setitem(formats.REGISTRY, "twin", formats.Format("twin", sharded=True, local_only=False, noun="twins"))
    monkeypatch.setitem(sinks.SINKS, "twin", TwinSink)
    monkeypatch.setitem(sources.SOURCES, "twin", TwinSamples)
    src = make_folder(tmp_path / "src", per_class=3)
    idx = shardkit.pack(str(src), str(tmp_path / "out"), format="twin", workers=1, progress=False)
    assert idx.kind == "twin" and idx.samples == 9
    ds = shardkit.StreamingDataset(str(tmp_path / "out"), shuffle=False)
    assert isinstance(ds.source, TwinSamples) and len(list(ds)) == 9
