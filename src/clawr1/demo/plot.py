"""The demo's learning curves as a PNG: preference score per optimizer step, one line per method."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def smoothed(rows: list[dict[str, Any]], window: int = 3) -> tuple[list[int], list[float]]:
    """Score per version, averaged over the replies of `window` consecutive versions (each version
    alone serves only about a batch of replies, so single points are noisy)."""
    xs, ys = [], []
    for i, row in enumerate(rows):
        group = rows[max(0, i - window + 1): i + 1]
        replies = sum(r["replies"] for r in group)
        xs.append(row["version"])
        ys.append(sum(r["score"] * r["replies"] for r in group) / replies)
    return xs, ys


def plot_runs(results: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display here
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for result in results:
        xs, ys = smoothed(result["per_version"])
        line, = ax.plot(xs, ys, marker="o", markersize=3, label=f"{result['method']} (live, 3-version mean)")
        if result.get("before") and result.get("after"):
            ax.plot([0, result["reached_version"]], [result["before"]["score"], result["after"]["score"]],
                    linestyle="none", marker="X", markersize=9, color=line.get_color(), alpha=0.8,
                    label=f"{result['method']} held-out, before / after")
    ax.set_xlabel("optimizer steps (policy version served)")
    ax.set_ylabel("preference score")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Simulated users, embedded SmolLM2-135M, 2 CPU cores")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
