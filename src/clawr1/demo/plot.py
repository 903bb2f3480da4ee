"""The demo's curves as a PNG: preference score (left) and reply quality (right) per policy version,
one colour per method, side by side so a score won by degenerate replies shows as a falling
quality curve next to a rising preference curve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clawr1.flows.plot import save_panels


def smoothed(rows: list[dict[str, Any]], window: int = 3, key: str = "score",
             weight: str = "replies") -> tuple[list[int], list[float]]:
    """`key` per version, averaged over the replies of `window` consecutive versions (each version
    alone serves only about a batch of replies, so single points are noisy). Versions with no
    value (nothing measured) are left out."""
    rows = [r for r in rows if r.get(key) is not None and r.get(weight)]
    xs, ys = [], []
    for i, row in enumerate(rows):
        group = rows[max(0, i - window + 1): i + 1]
        total = sum(r[weight] for r in group)
        xs.append(row["version"])
        ys.append(sum(r[key] * r[weight] for r in group) / total)
    return xs, ys


def plot_runs(results: list[dict[str, Any]], out: Path, model: str = "the embedded model") -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display here
    import matplotlib.pyplot as plt

    fig, (pref, qual) = plt.subplots(1, 2, figsize=(12, 4.2), dpi=120, sharex=True)
    for result in results:
        method = result["method"]
        xs, ys = smoothed(result["per_version"])
        line, = pref.plot(xs, ys, marker="o", markersize=3, label=f"{method}: users' score (live, 3-version mean)")
        color = line.get_color()
        xs, ys = smoothed(result["per_version"], key="sane_rate", weight="measured")
        if xs:
            qual.plot(xs, ys, marker="o", markersize=3, color=color, label=f"{method}: sane rate (live)")
        curve = result.get("curve") or [  # runs from before the curve: their before/after points
            {**point, "version": version} for point, version in ((result.get("before"), 0),
                                                                 (result.get("after"), result["reached_version"]))
            if point]
        points = [(c["version"], c) for c in curve]
        if points:
            pref.plot([v for v, _ in points], [c["score"] for _, c in points], linestyle="--", marker="X",
                      markersize=7, color=color, alpha=0.8, label=f"{method}: held-out score")
            kept = [(v, c["preferred_and_sane"]) for v, c in points if c.get("preferred_and_sane") is not None]
            if kept:
                pref.plot(*zip(*kept), linestyle=":", marker="s", markersize=5, color=color, alpha=0.8,
                          label=f"{method}: held-out preferred and sane")
            strict = [(v, c["preferred_sane_substantive"]) for v, c in points
                      if c.get("preferred_sane_substantive") is not None]
            if strict:
                pref.plot(*zip(*strict), linestyle="-.", marker="^", markersize=5, color=color, alpha=0.8,
                          label=f"{method}: held-out preferred, sane and substantive")
            sane = [(v, c["sane_rate"]) for v, c in points if c.get("sane_rate") is not None]
            if sane:
                qual.plot(*zip(*sane), linestyle="--", marker="X", markersize=7, color=color, alpha=0.8,
                          label=f"{method}: held-out sane rate")
    # A run from before the quality numbers draws nothing on the right: it gets no legend there.
    return save_panels(fig, [(pref, "preference score"), (qual, "sane rate (within the base model's range)")],
                       "optimizer steps (policy version served)",
                       f"Simulated users, {model}: preference and quality per version", out, legend_size=6)


def plot_memory(memory_run: dict[str, Any], weights_run: dict[str, Any] | None, out: Path,
                model: str = "the embedded model") -> Path:
    """The memory's comparison (`clawr1 demo --memory`): held-out preferred-and-sane (left) and sane
    rate (right) per version, four ways: the weights alone of a run without memory (`weights_run`,
    today's loop), the memory alone (the base's weights, asked as the users), both (the memory run
    as served), and the memory run's weights without its memory (what consolidation put there)."""
    import matplotlib

    matplotlib.use("Agg")  # no display here
    import matplotlib.pyplot as plt

    def series(curve: list[dict[str, Any]], key: str, part: str | None) -> tuple[list[int], list[float]]:
        # At the version the users were served when it was measured (the memory alone: the base's
        # weights with the entries made by then); the base's point (before anyone talked, no
        # memory yet) starts every way.
        points = [(c["version"], c if part is None or c["version"] == 0 else c.get(part, {})) for c in curve]
        kept = [(v, p[key]) for v, p in points if p.get(key) is not None]
        return [v for v, _ in kept], [y for _, y in kept]

    ways = [("memory and weights (as served)", memory_run["curve"], None, "-"),
            ("memory alone (base weights)", memory_run["curve"], "memory_alone", "--"),
            ("weights alone, trained with memory (consolidated)", memory_run["curve"], "weights_alone", "-.")]
    if weights_run is not None:
        ways.insert(1, ("weights alone, trained without memory", weights_run["curve"], None, ":"))
    fig, (pref, qual) = plt.subplots(1, 2, figsize=(12, 4.2), dpi=120, sharex=True)
    for label, curve, part, style in ways:
        for ax, key in ((pref, "preferred_and_sane"), (qual, "sane_rate")):
            xs, ys = series(curve, key, part)
            if xs:
                ax.plot(xs, ys, linestyle=style, marker="o", markersize=4, label=label)
    return save_panels(fig, [(pref, "held-out preferred and sane"), (qual, "held-out sane rate")],
                       "optimizer steps (policy version served)",
                       f"Corrections through the memory, the weights, or both ({model})", out, legend_size=7)
