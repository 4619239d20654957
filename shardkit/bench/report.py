"""`shardkit bench`'s report: the table of settings with its verdicts and recommendation
(`format_report`), and the chart of images/s against the varied setting (`write_plot`)."""

from __future__ import annotations

import os
from typing import Any

from ..errors import ShardkitError
from .harness import agg_figure, aligned


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def format_report(doc: dict[str, Any]) -> str:
    """The table, the data-bound verdicts (with step_ms) and the recommendation line."""
    head = ("num_workers", "prefetch", "images/s", "MB/s", "first batch", "peak RSS (workers)")
    rows = [head]
    for s in doc["settings"]:
        rows.append(
            (
                str(s["num_workers"]),
                str(s["prefetch"]),
                f"{s['mean_images_per_s']:.0f} ± {s['std_images_per_s']:.0f}",
                f"{s['mean_mb_per_s']:.1f} ± {s['std_mb_per_s']:.1f}",
                f"{s['first_batch_s']:.2f} s",
                f"{_mib(s['peak_rss_bytes'])} ({_mib(_minus(s['peak_rss_bytes'], s['peak_main_rss_bytes']))})",
            )
        )
    lines = [
        f"{doc['url']}: batch size {doc['batch_size']}, decode {doc['decode']}, transform {doc['transform']}; "
        f"{doc['passes']} pass{'es' * (doc['passes'] != 1)} of {doc['batches']} batch{'es' * (doc['batches'] != 1)} "
        f"after {doc['warmup']} warm-up batch{'es' * (doc['warmup'] != 1)}"
    ]
    lines += aligned(rows)
    step = doc.get("step_ms")
    if step is not None:
        for s in doc["settings"]:
            name = f"{doc['varied']}={s[doc['varied']]}"
            relation = ">" if s["data_bound"] else "<="
            line = f"{name}: {s['batch_ms']:.1f} ms per batch {relation} {step:g} ms step: "
            if s["data_bound"]:
                line += "data-bound"
            elif s["num_workers"] == 0:  # loading runs in the training process, between steps
                line += f"not data-bound, but without workers each step also waits {s['batch_ms']:.1f} ms for its batch"
            else:
                line += "keeps up"
            lines.append(line)
    skipped = max(s["stats"]["skipped"] for s in doc["settings"])
    if skipped:
        lines.append(f"skipped bad samples: up to {skipped:.0f} per setting (replaced, so batches stay full)")
    lines.append(f"recommendation: {doc['recommendation']['text']}")
    return "\n".join(lines)


def _minus(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


def write_plot(doc: dict[str, Any], path: str) -> None:
    """An error-bar chart of images/s (mean ± std over passes) against the varied setting."""
    try:
        fig = agg_figure((6, 4), dpi=100)
    except ImportError:
        raise ShardkitError("--plot needs matplotlib: pip install matplotlib") from None
    varied, settings = doc["varied"], sorted(doc["settings"], key=lambda s: s[doc["varied"]])
    ax = fig.add_subplot()
    xs = list(range(len(settings)))
    ax.errorbar(
        xs,
        [s["mean_images_per_s"] for s in settings],
        yerr=[s["std_images_per_s"] for s in settings],
        fmt="o-",
        capsize=4,
    )
    ax.set_xticks(xs, [str(s[varied]) for s in settings])
    ax.set_xlabel(varied)
    ax.set_ylabel("images/s (mean ± std over passes)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"batch size {doc['batch_size']}, decode {doc['decode']}", fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    ext = os.path.splitext(path)[1].lower().lstrip(".")  # b.jpg a JPEG, as preview writes; anything else a PNG
    fig.savefig(path, format=ext if ext in fig.canvas.get_supported_filetypes() else "png")
