"""A held-out curve as a PNG: task success per version with its 95% interval (left) and the sane
rate of the last replies (right), side by side, so a version that wins by degenerate output shows
as a falling quality curve next to a rising success curve."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_curve(curve: list[dict[str, Any]], out: Path, title: str) -> Path:
    """`curve`: `TrainFlowResult.curve` (or its JSON), one point per evaluated version."""
    import matplotlib

    matplotlib.use("Agg")  # no display here
    import matplotlib.pyplot as plt

    if not curve:
        raise ValueError("no held-out points to plot (train-flow --heldout)")
    fig, (succ, qual) = plt.subplots(1, 2, figsize=(11, 4), dpi=120, sharex=True)
    xs = [p["version"] for p in curve]
    ys = [p["success"] for p in curve]
    errors = [[y - p["ci95"][0] for y, p in zip(ys, curve)], [p["ci95"][1] - y for y, p in zip(ys, curve)]]
    succ.errorbar(xs, ys, yerr=errors, marker="o", capsize=4, label="held-out success (95% interval)")
    families = sorted({f for p in curve for f in p["by_family"]})
    for family in families if len(families) > 1 else []:
        succ.plot(xs, [p["by_family"].get(family) for p in curve], linestyle=":", marker=".", label=family)
    sane = [(p["version"], p["sane_rate"]) for p in curve if p.get("sane_rate") is not None]
    if sane:
        qual.plot(*zip(*sane), marker="o", color="tab:green", label="sane rate of the last replies")
    return save_panels(fig, [(succ, "success"), (qual, "sane rate (within the base model's range)")],
                       "policy version", title, out)


def save_panels(fig: Any, panels: list[tuple[Any, str]], xlabel: str, title: str, out: Path,
                legend_size: int = 7) -> Path:
    """The finish every side-by-side rate plot shares (held-out curves, the demo's): axes labelled
    and bounded to [0, 1], a legend where something was drawn, the figure written to `out`."""
    import matplotlib.pyplot as plt

    for ax, label in panels:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a panel with nothing drawn gets no empty legend
            ax.legend(fontsize=legend_size, loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
