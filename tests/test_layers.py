"""The package's layering, read from its imports: a module imports only from its own layer's
package or from lower layers (see docs/design.md), inside the packages too, and no modules
import each other in a circle. Every import counts: those under `if TYPE_CHECKING:` and
inside functions as well (a type-only cycle is still two modules that must know each other)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "shardkit"

# lowest first; a module may import from its own layer's unit (same file, or same package) and below
LAYERS: list[dict[str, str]] = [
    {"errors": "errors", "units": "units", "interrupts": "interrupts"},
    {"checks": "checks"},
    {"formats": "formats", "order": "order", "decode": "decode"},
    {"storage": "storage"},
    {"index": "index"},
    {"packing": "packing", "reading": "reading"},
    {"bench": "bench"},
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
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            names = [".".join([*base, node.module])] if node.module else [".".join([*base, a.name]) for a in node.names]
            found += [(n, node.lineno) for n in names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardkit."):
            found.append((node.module.removeprefix("shardkit."), node.lineno))  # type: ignore[union-attr]
        elif isinstance(node, ast.Import):
            found += [
                (a.name.removeprefix("shardkit."), node.lineno) for a in node.names if a.name.startswith("shardkit.")
            ]
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
        assert LEVEL[there] < LEVEL[here], (
            f"{path.name}:{line} imports {imported} (layer {LEVEL[there]}) from layer {LEVEL[here]}"
        )


def test_packing_and_reading_do_not_import_each_other() -> None:
    for side, other in (("packing", "reading"), ("reading", "packing")):
        for path in (PACKAGE / side).rglob("*.py"):
            assert not [m for m, _ in _imports(path) if _unit(m) == other], f"{path} imports from {other}"


def test_only_storage_clients_imports_fsspec() -> None:
    users = [
        p
        for p in MODULES
        if any(
            (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "fsspec" for a in n.names))
            or (isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] == "fsspec")
            for n in ast.walk(ast.parse(p.read_text()))
        )
    ]
    assert [p.relative_to(PACKAGE).as_posix() for p in users] == ["storage/clients.py"]


def test_every_format_has_a_sink_named_as_it() -> None:
    from shardkit.formats import FORMATS
    from shardkit.packing.sinks import SINKS
    from shardkit.reading.sources import SOURCES

    assert tuple(SINKS) == FORMATS and all(SINKS[name].name == name for name in FORMATS)
    assert tuple(SOURCES) == FORMATS and all(SOURCES[name].format == name for name in FORMATS)


# Inside a package, lowest first: a module imports only its own layer's modules and those below
INNER: dict[str, list[set[str]]] = {
    "reading": [
        {"worker", "prefetch", "counters", "state", "ordering"},
        {"spec", "segments", "batch_layout", "shared_batch", "batching", "epoch_stream", "sources", "resume"},
        {"pass_", "epochs", "map_records"},
        {"mix", "map_dataset"},
        {"tar_dataset", "lmdb_dataset"},
        {"dataset"},
    ],
    "storage": [
        {"urls", "descriptors", "cache", "seqwrite", "streams", "latencies", "fingerprint", "daemon_threads"},
        {"patience"},
        {"retry", "clients"},
        {"s3_signer", "s3_connections"},
        {"s3_presignable"},
        {"s3_http"},
        {"s3_config"},
        {"stores"},
        {"files", "atomic", "fetch"},
        {"range_reader"},
    ],
    "formats": [
        {"tar", "lmdb_records"},
        {"gzip", "tar_writer", "tar_sample", "lmdb_envs", "lmdb_cold_reads"},
        {"lmdb_writer"},
        {"lmdb"},
    ],
    "index": [{"offsets"}, {"model"}, {"io"}, {"resolve"}],
    "order": [{"blockplan", "digest", "turns"}, {"partition", "globalbatch", "ranges"}, {"progress"}],
    "decode": [{"jpeg"}, {"fields"}, {"transforms"}],
    "bench": [{"harness", "memory", "transforms", "report"}, {"loader"}],
    "reading.sources": [{"base"}, {"compressed"}, {"tar", "lmdb"}],
    "cli": [{"options"}, {"pack", "read", "bench"}, {"__main__"}],
    "packing": [
        {"listing", "images", "lock_flock", "lock_lease", "executors"},
        {"lock", "sidecars"},
        {"inputs"},
        {"plan"},
        {"jobs"},
        {"commit"},
        {"sinks"},
        {"pack"},
    ],
    "packing.inputs": [{"kind"}, {"folder", "manifest", "dataset"}],
    "packing.sinks": [{"tar", "lmdb"}],
    "storage.stores": [
        {"base", "forks"},
        {"local", "fsspec"},
        {"s3", "azure"},
        {"obstore_s3"},
        {"obstore_gcs"},
        {"choice"},
    ],
}


def _module_of(name: str) -> str | None:
    """The module file a dotted name within shardkit is, if it is one ('' is the package)."""
    parts = [p for p in name.split(".") if p]
    if (PACKAGE.joinpath(*parts).with_suffix(".py")).is_file():
        return ".".join(parts)
    if (PACKAGE.joinpath(*parts, "__init__.py")).is_file():
        return ".".join([*parts, "__init__"])
    return None


@pytest.mark.parametrize("package", sorted(INNER))
def test_imports_flow_down_inside_packages(package: str) -> None:
    level = {m: n for n, layer in enumerate(INNER[package]) for m in layer}
    folder = PACKAGE.joinpath(*package.split("."))
    files = sorted(p for p in folder.glob("*.py") if p.name != "__init__.py")
    files += sorted(p / "__init__.py" for p in folder.iterdir() if (p / "__init__.py").is_file())
    name = {p: p.parent.name if p.name == "__init__.py" else p.stem for p in files}
    assert set(name.values()) == set(level), f"{package}/: place every module in INNER"
    depth = len(package.split("."))
    for path in files:
        for imported, line in _imports(path):
            parts = imported.split(".")
            if parts[:depth] != package.split(".") or len(parts) <= depth or parts[depth] == name[path]:
                continue
            there = parts[depth]
            assert level[there] <= level[name[path]], (
                f"{path}:{line} imports {imported} (layer {level[there]}) from layer {level[name[path]]}"
            )


def test_no_modules_import_each_other_in_a_circle() -> None:
    graph: dict[str, set[str]] = {}
    for path in MODULES:
        here = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        graph[here] = {m for name, _ in _imports(path) if (m := _module_of(name)) is not None and m != here}
    # a package's __init__ importing its own modules is how a package is made, not a circle
    for here, out in graph.items():
        if here.endswith("__init__"):
            base = here.removesuffix("__init__")
            graph[here] = {m for m in out if not m.startswith(base)} if base else set()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(node) :], node]))
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*path, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
