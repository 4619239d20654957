"""The package's layering, read from its imports: a module imports only from its own layer's
package or from lower layers (see docs/design.md). Imports under `if TYPE_CHECKING:` are
annotations only and do not count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "shardkit"

# lowest first; a module may import from its own layer's unit (same file, or same package) and below
LAYERS: list[dict[str, str]] = [
    {"errors": "errors", "units": "units"},
    {"checks": "checks", "blockplan": "blockplan"},
    {"storage": "storage"},
    {"sidecar": "sidecar"},
    {"index": "index"},
    {"jpeg": "jpeg"},
    {"formats": "formats", "partition": "partition", "ranges": "ranges", "prefetch": "prefetch", "decode": "decode"},
    {"sources": "sources"},
    {"packing": "packing", "reading": "reading"},
    {"tools": "tools"},
    {"cli": "cli", "__init__": "__init__"},
    {"__main__": "__main__"},
]
LEVEL = {unit: n for n, layer in enumerate(LAYERS) for unit in layer}


def _unit(module: str) -> str:
    """The unit a dotted module (within shardkit) belongs to: its top-level name."""
    return module.split(".")[0]


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported shardkit module, line) for each runtime import in `path`."""
    module = path.relative_to(PACKAGE).with_suffix("").parts
    package = list(module[:-1]) if path.name != "__init__.py" else list(module[:-1])
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            names = [".".join([*base, node.module])] if node.module else [".".join([*base, a.name]) for a in node.names]
            found += [(n, node.lineno) for n in names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardkit."):
            found.append((node.module.removeprefix("shardkit."), node.lineno))  # type: ignore[union-attr]
        elif isinstance(node, ast.Import):
            found += [(a.name.removeprefix("shardkit."), node.lineno) for a in node.names if a.name.startswith("shardkit.")]
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_flow_down(path: Path) -> None:
    here = _unit(".".join(path.relative_to(PACKAGE).with_suffix("").parts))
    assert here in LEVEL, f"{path}: not in any layer of this test: place it"
    for imported, line in _imports(path):
        there = _unit(imported) if imported else "__init__"
        if there == here:
            continue
        assert LEVEL[there] < LEVEL[here], f"{path.name}:{line} imports {imported} (layer {LEVEL[there]}) from layer {LEVEL[here]}"


def test_packing_and_reading_do_not_import_each_other() -> None:
    for side, other in (("packing", "reading"), ("reading", "packing")):
        for path in (PACKAGE / side).rglob("*.py"):
            assert not [m for m, _ in _imports(path) if _unit(m) == other], f"{path} imports from {other}"


def test_only_storage_clients_imports_fsspec() -> None:
    users = [p for p in MODULES if any((isinstance(n, ast.Import) and any(a.name.split(".")[0] == "fsspec" for a in n.names))
                                       or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "fsspec")
                                       for n in ast.walk(ast.parse(p.read_text())))]
    assert [p.relative_to(PACKAGE).as_posix() for p in users] == ["storage/clients.py"]


def test_every_format_has_a_sink_named_as_it() -> None:
    from shardkit.formats import FORMATS
    from shardkit.packing.pack import SINKS

    assert tuple(SINKS) == FORMATS and all(SINKS[name].name == name for name in FORMATS)
