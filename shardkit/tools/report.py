"""What the `shardkit` commands say, as text: the Python API's results turned into lines.

Pure functions, no click and no printing, so the command line stays a thin caller and a
notebook or a test gets the same words from the same results. A function returns the lines
of one stream; the command decides where each goes (summaries to stdout, what went wrong
or was left out to stderr).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from .. import formats
from ..errors import SKIP_BAD, one_line, shown_name
from ..units import format_size

SHOWN_SKIPPED = 10  # files left out named one a line; the rest counted, with where to read them all


def plural(n: int, noun: str) -> str:
    """'1 shard', '2 shards'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def message(e: BaseException) -> str:
    """An error's message, on one line. One raised in a DataLoader worker comes back with the
    worker's traceback as its message ("Caught X in DataLoader worker process 0. Original
    Traceback ..."): its last line is the worker's own message."""
    text = str(e)
    if text.startswith("Caught ") and "Original Traceback" in text:
        last = text.rstrip().splitlines()[-1]
        text = last.partition(": ")[2] if re.match(r"[\w.]+: ", last) else last
    return one_line(text)


def in_cli_words(text: str) -> str:
    """A reader's advice on bad samples as bench and preview take it."""
    return text.replace(SKIP_BAD, "--on-error skip leaves bad samples out")


def sort_skipped(skipped: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """(files left out as unusable, hidden entries left alone): .DS_Store is no bad input."""
    from ..packing.inputs.folder import HIDDEN

    return [s for s in skipped if s.reason != HIDDEN], [s for s in skipped if s.reason == HIDDEN]


def skipped_lines(skipped: Sequence[Any], url: str) -> list[str]:
    """The first ten files left out, a line each, then how many more and where they are listed."""
    lines = [f"  {shown_name(s.path)}: {s.reason}" for s in skipped[:SHOWN_SKIPPED]]
    if len(skipped) > SHOWN_SKIPPED:
        lines.append(f"  ... and {len(skipped) - SHOWN_SKIPPED} more (shardkit info --json {url})")
    return lines


def hidden_note(hidden: Sequence[Any]) -> str:
    """'2 hidden entries (.DS_Store, a/.DS_Store)', the first three named."""
    names = ", ".join(shown_name(s.path) for s in hidden[:3]) + (", ..." if len(hidden) > 3 else "")
    return f"{len(hidden)} hidden {'entry' if len(hidden) == 1 else 'entries'} ({names})"


def layout_hint(unusable: Sequence[Any], samples: int) -> str:
    """A hint to pack with --layout flat where most files sat outside any class folder."""
    from ..packing.inputs.folder import OUTSIDE_CLASSES

    outside = sum(s.reason == OUTSIDE_CLASSES for s in unusable)
    if outside <= samples:
        return ""
    return (
        f"hint: {plural(outside, 'file')} not inside a class folder, {plural(samples, 'sample')} packed: "
        "for images without classes (SRC/<image>), pack with --layout flat"
    )


def pack_summary(idx: Any, dest: str, stats: Mapping[str, int], took: float) -> str:
    """The line a pack ends with: what DEST holds now, and what this run did to get there."""
    sharded = formats.get(idx.kind).sharded
    where = f"{plural(len(idx.shards), 'shard')}" if sharded else formats.get(idx.kind).noun
    empty = sum(s.samples == 0 for s in idx.shards)
    if empty and sharded:  # valid shards (readers skip them), but worth knowing about
        where += f" ({empty} empty: every file in {'it' if empty == 1 else 'them'} was skipped)"
    samples, size = plural(idx.samples, "sample"), format_size(idx.bytes)
    if stats["unchanged"]:
        return f"{dest}: already holds this pack ({samples} in {where}, {size}): nothing to do"
    if not stats["written"]:  # every shard was there: a crash before the index
        return f"finished the pack in {dest}: index.json written ({samples} in {where}, {size})"
    kept = f"; {stats['kept']} kept from an earlier run" if stats["kept"] else ""
    return f"packed {samples} into {where} ({size}) in {took:.1f} s: {stats['written'] / took:.0f} source files/s{kept}"


def pack_warnings(idx: Any, dest: str, layout: str, quiet: bool) -> list[str]:
    """What a pack left out, for stderr: bad input is never silent, even with --quiet (one line then)."""
    unusable, hidden = sort_skipped(idx.skipped)
    hint = layout_hint(unusable, idx.samples) if layout == "classes" else ""
    lines = []
    if quiet:
        if unusable:
            lines.append(f"skipped {plural(len(unusable), 'unusable file')} (shardkit info {dest} lists them)")
    else:
        if unusable:
            lines += [f"skipped {plural(len(unusable), 'file')}:", *skipped_lines(unusable, dest)]
        if hidden:
            lines.append(f"ignored {hidden_note(hidden)}")
    return [*lines, hint] if hint else lines


def classes_note(idx: Any) -> str:
    """'3 (cat, dog, fox)', or what is known where the index names no classes."""
    if idx.classes:
        return f"{len(idx.classes)} (" + ", ".join(idx.classes[:8]) + (", ..." if len(idx.classes) > 8 else "") + ")"
    if "cls" in idx.fields:  # another tool's shards: labels, but no names for them
        return "unknown (the index names none; samples carry a cls field)"
    return "none (no cls field)"


def shard_counts(counts: list[int]) -> str:
    """'4 (310-315 samples each)', '4 (315 samples each)', '1 (315 samples)'."""
    low, high = min(counts, default=0), max(counts, default=0)
    each = plural(high, "sample") if low == high else f"{low}-{high} samples"
    return f"{len(counts)} ({each}{' each' * (len(counts) > 1)})"


def info_lines(idx: Any, shown_url: str) -> list[str]:
    """`shardkit info`'s summary of an index, `shown_url` being the dataset's URL as it may be shown."""
    lines = [
        f"dataset:  {shown_url}",
        f"format:   {idx.kind}, fields {', '.join(idx.fields)}",
        f"samples:  {idx.samples}",
    ]
    if formats.get(idx.kind).sharded:  # an LMDB is one file, not shards
        lines.append(f"shards:   {shard_counts([s.samples for s in idx.shards])}")
    lines.append(f"bytes:    {format_size(idx.bytes)}")
    packed = sum(s.compression is not None for s in idx.shards)
    if packed:
        lines.append(f"compressed: {packed} of {len(idx.shards)} shards (gzip: read as streams, no random access)")
    lines.append(f"classes:  {classes_note(idx)}")
    unusable, hidden = sort_skipped(idx.skipped)
    lines += [f"skipped:  {plural(len(unusable), 'file')}", *skipped_lines(unusable, shown_url)]
    if hidden:
        lines.append(f"ignored:  {hidden_note(hidden)}")
    return lines


def store_lines(decided: Mapping[str, Any]) -> list[str]:
    """A store's own account of itself (its `describe()`: the store's name first) as info -v shows it."""
    rest = dict(decided)
    return [f"store:    {rest.pop('store')}", *(f"  {name + ':':<12}{value}" for name, value in rest.items())]


def verify_ok(name: str, samples: int, unhashed: bool) -> str:
    """A shard that matched its index entry (`unhashed`: it has no sha256 there, so its bytes went unchecked)."""
    return f"ok   {name} ({plural(samples, 'sample')})" + (" (no sha256 in the index)" if unhashed else "")


def verify_failure(problems: int, one_file: str | None, shown_url: str, decode: bool) -> str:
    """verify's error when shards do not match (`one_file`: the dataset is that one file, an LMDB)."""
    skipped = "; the images were not decoded" if decode else ""
    what = f"{one_file} is bad" if one_file else plural(problems, "bad shard")
    return f"{what} in {shown_url}{skipped}"


def unhashed_note(unhashed: int) -> str:
    return (
        f"{plural(unhashed, 'shard')} without a sha256 in the index: sizes, counts and offsets match, "
        "their bytes were not checked"
    )


def undecodable_failure(bad: int, shown_url: str) -> str:
    return (
        f'images that do not decode in {shown_url}: {bad} (readers leave them out with on_error="skip", '
        "bench and preview with --on-error skip; `shardkit pack --decode-check` keeps them out of a pack)"
    )


def indexed(idx: Any) -> str:
    return f"indexed {plural(idx.samples, 'sample')} in {plural(len(idx.shards), 'shard')} ({format_size(idx.bytes)})"


def versions_recorded(idx: Any) -> str:
    return f"recorded the versions of {plural(sum(s.version is not None for s in idx.shards), 'shard')}"


def nothing_to_upgrade(idx: Any, index_name: str) -> str | None:
    """Why an index needs no upgrade (None: it does): it is an LMDB's, or of version 2 already."""
    fmt = formats.get(idx.kind)
    if fmt.sharded and idx.offsets_file is None:
        return None
    what = "of version 2 already" if fmt.sharded else f"{fmt.noun}'s index (its keys stay inside it)"
    return f"{index_name} is {what}: nothing to upgrade"


def upgraded(idx: Any, saved: Any, index_name: str, version: int) -> str:
    return (
        f"upgraded {index_name} to version {version}: the offsets of {plural(idx.samples, 'sample')} "
        f"are in {saved.offsets_file.file}"
    )


def bench_progress(setting: Mapping[str, Any]) -> str:
    """One finished bench setting, for stderr while the others run."""
    return (
        f"  num_workers={setting['num_workers']} prefetch={setting['prefetch']}: "
        f"{setting['mean_images_per_s']:.0f} ± {setting['std_images_per_s']:.0f} images/s"
    )


def preview_written(out: str, result: Mapping[str, Any]) -> str:
    cols, rows = result["grid"]
    width, height = result["size"]
    skipped = f", {plural(result['skipped'], 'bad sample')} skipped" if result["skipped"] else ""
    return f"wrote {out}: {plural(result['samples'], 'sample')}, {cols}x{rows} grid, {width}x{height} px{skipped}"
