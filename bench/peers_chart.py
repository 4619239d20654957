"""The README's "How it compares" table and docs/peers.png, both drawn from one summary JSON.

bench/peers.py writes the summary (bench-out/peers-summary.json) beside its full results;
docs/peers.json is the one behind the README, so the chart is redrawn from the recorded
figures without rerunning the benchmark, and tests/test_docs.py checks that the README's
table is the one this renders:

    python -m bench.peers_chart docs/peers.json docs/peers.png   # the chart, and the table on stdout

Summary: {"command", "date", "images", "workers", "batch", "decode_limit": {median, min, max},
"rows": [{"label", "shardkit" (bold in the table), "pack" (images/s or null),
"decoded": {median, min, max}, "first_batch_s", "peak_rss_mb"}]}, rows in table order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

HEADER = "| | pack images/s | decoded images/s | first batch s | peak RSS MB |\n|---|---|---|---|---|\n"
SHARDKIT, PEER, PLAIN = "#1f5fa8", "#6f8fb3", "#8c8c8c"  # bar colours: shardkit, another loader, plain files
DIGEST_KEY = "peers-summary-sha256"  # PNG text chunk: the summary the chart was drawn from


def load(path: str | Path) -> dict[str, Any]:
    """The summary, or one line naming the file and what it lacks."""
    try:
        summary = json.loads(Path(path).read_text())
        for row in summary["rows"]:
            missing = {"label", "shardkit", "pack", "decoded", "first_batch_s", "peak_rss_mb"} - row.keys()
            if missing or {"median", "min", "max"} - row["decoded"].keys():
                raise KeyError(f"row {row.get('label')!r} lacks {sorted(missing) or 'decoded median/min/max'}")
        lacking = {"command", "date", "images", "workers", "decode_limit"} - summary.keys()
        if lacking:
            raise KeyError(f"no {sorted(lacking)}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{path}: not a peers summary: {type(e).__name__}: {e}") from None
    return summary


def digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def spread(stat: dict[str, float]) -> str:
    return f"{stat['median']:,.0f} ({stat['min']:,.0f}-{stat['max']:,.0f})"


def table(summary: dict[str, Any]) -> str:
    """The markdown table, as the README shows it: shardkit's rows in bold."""
    lines = []
    for row in summary["rows"]:
        label = row["label"].replace("image_transform(256, crop=224)", "`image_transform(256, crop=224)`")
        cells = [
            label,
            "-" if row["pack"] is None else f"{row['pack']:,.0f}",
            spread(row["decoded"]),
            f"{row['first_batch_s']:.2f}",
            f"{row['peak_rss_mb']:,.0f}",
        ]
        if row["shardkit"]:
            cells = [f"**{c}**" if c != "-" else c for c in cells]
        lines.append("| " + " | ".join(cells) + " |\n")
    return HEADER + "".join(lines)


def colour(row: dict[str, Any]) -> str:
    return SHARDKIT if row["shardkit"] else PLAIN if row["label"].startswith("plain files") else PEER


def draw(summary: dict[str, Any], path: str | Path, source_digest: str) -> list[tuple[str, float]]:
    """Horizontal bars, one per table row and in its order (labels of any length stay readable),
    each with its median and min-max written inside it; the PIL decode limit as a dashed line;
    the legend under the axes, clear of the bars. Returns (label, bar length) as drawn, top first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = summary["rows"]
    meds = [r["decoded"]["median"] for r in rows]
    err = [
        [r["decoded"]["median"] - r["decoded"]["min"] for r in rows],
        [r["decoded"]["max"] - r["decoded"]["median"] for r in rows],
    ]
    limit = summary["decode_limit"]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(rows) + 2.2))
    y = range(len(rows))
    ax.barh(
        y,
        meds,
        xerr=err,
        capsize=3,
        color=[colour(r) for r in rows],
        height=0.6,
        error_kw={"elinewidth": 1, "ecolor": "#333333"},
    )
    ax.set_yticks(list(y), [r["label"].replace("shardkit, ", "shardkit,\n") for r in rows], fontsize=9)
    ax.invert_yaxis()  # the table's first row on top
    right = max(r["decoded"]["max"] for r in rows)
    for i, r in enumerate(rows):  # inside the bar, at its start: clear of the error bar and the limit line
        ax.text(
            right * 0.012,
            i,
            spread(r["decoded"]),
            va="center",
            fontsize=8.5,
            color="white",
            fontweight="bold" if r["shardkit"] else "normal",
        )
    ax.axvline(limit["median"], color="black", linestyle="--", linewidth=1)
    ax.set_xlim(0, right * 1.05)
    ax.set_xlabel("decoded images/s: median (min-max) of interleaved rounds")
    ax.set_title(
        f"DataLoader(num_workers={summary['workers']}): JPEG -> 224x224 CHW uint8, "
        f"{summary['images']:,} images ({summary['date'].split()[0]})",
        fontsize=10,
    )
    ax.spines[["top", "right"]].set_visible(False)
    handles = [
        Patch(color=SHARDKIT, label="shardkit"),
        Patch(color=PEER, label="another loader"),
        Patch(color=PLAIN, label="plain files"),
        Line2D(
            [],
            [],
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"PIL decode limit ({summary['workers']} processes, no loader): {spread(limit)}",
        ),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120, metadata={DIGEST_KEY: source_digest})
    drawn = [
        (t.get_text().replace("\n", " "), float(bar.get_width())) for t, bar in zip(ax.get_yticklabels(), ax.patches)
    ]
    plt.close(fig)
    return drawn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("summary", help="a summary JSON (docs/peers.json, or bench-out/peers-summary.json)")
    ap.add_argument("png", help="the chart to write")
    args = ap.parse_args(argv)
    summary = load(args.summary)
    draw(summary, args.png, digest(args.summary))
    sys.stdout.write(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
