"""Line charts as inline SVG, rendered on the server: no JavaScript library, no CDN, and a page that
shows its curves even with scripts off. Each point carries a `<title>` (hover for its value)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 460, 210
LEFT, RIGHT, TOP, BOTTOM = 46, 12, 10, 32  # plot margins: y labels left, x labels below


@dataclass(frozen=True)
class Series:
    name: str
    points: list[tuple[float, float]]  # (x, y); None values are left out by the caller
    css: str  # a class from dashboard.css that gives the colour


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high] (1, 2 or 5 times a power of ten apart)."""
    if high <= low:
        high = low + 1.0
    raw = (high - low) / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.floor(low / step) * step
    return [first + i * step for i in range(math.ceil((high - first) / step) + 1)]


def _label(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 10 or value == int(value) else f"{value:.2g}"


def line_chart(title: str, series: list[Series], *, x_label: str, y_range: tuple[float, float] | None = None,
               y_unit: str = "") -> str:
    """An SVG line chart of `series` over a shared x axis; an empty chart says it has no data yet."""
    drawn = [s for s in series if s.points]
    points = [p for s in drawn for p in s.points]
    keys = "".join(f'<span class="key {s.css}">{escape(s.name)}</span>' for s in drawn)
    head = (f'<figure class="chart"><figcaption>{escape(title)} {keys}</figcaption>'
            f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}" '
            f'data-series="{len(drawn)}" data-points="{len(points)}">')
    if not points:
        return head + (f'<text class="empty" x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">'
                       'no data yet</text></svg></figure>')
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_lo, x_hi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y_lo, y_hi = y_range or (min(ys), max(ys))
    y_ticks = _ticks(y_lo, y_hi)
    y_lo, y_hi = (y_lo, y_hi) if y_range else (y_ticks[0], y_ticks[-1])
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(x: float) -> float:
        return LEFT + (x - x_lo) / (x_hi - x_lo) * plot_w

    def sy(y: float) -> float:
        return TOP + (1 - (y - y_lo) / ((y_hi - y_lo) or 1)) * plot_h

    parts = [head]
    for tick in (t for t in y_ticks if y_lo <= t <= y_hi):
        y = sy(tick)
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
                     f'<text class="tick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_label(tick)}{y_unit}</text>')
    for tick in (t for t in _ticks(x_lo, x_hi, 6) if x_lo <= t <= x_hi and t == int(t)):
        parts.append(f'<text class="tick" x="{sx(tick):.1f}" y="{TOP + plot_h + 14}" text-anchor="middle">'
                     f'{_label(tick)}</text>')
    parts.append(f'<text class="axis" x="{LEFT + plot_w / 2}" y="{HEIGHT - 4}" text-anchor="middle">'
                 f'{escape(x_label)}</text>')
    for s in drawn:
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s.points)
        parts.append(f'<g class="series {s.css}"><polyline points="{coords}"/>')
        parts += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3"><title>{escape(s.name)} at {_label(x)}: '
                  f'{y:.3g}{y_unit}</title></circle>' for x, y in s.points]
        parts.append("</g>")
    parts.append("</svg></figure>")
    return "".join(parts)
