"""The base model's normal range of each measure, and the sanity test against it.

The thresholds are not absolute numbers: what counts as relevant or fluent depends on the model,
the template and the kind of request. So they come from the base model's own replies to the same
kind of request, and a reply is sane when it looks like something the base model would say.

Statistics, chosen to hold with 16-48 replies (checked by drawing 300 subsets from 88 SmolLM2-135M
replies to 44 everyday questions, T=0.7, 64 tokens):
- The low edge of relevance and fluency is their 10th percentile (linear interpolation: with 16
  replies it lies between the 2nd and 3rd lowest, so one wild reply does not move it), lowered by
  a margin of the distance from that percentile to the median (for a normal distribution: about
  2.6 standard deviations below the mean). The margin scales with the measure's own spread, so
  one rule serves cosines (0..1) and logprobs (nats). Fluency's edge from 16 replies: -2.19 +- 0.24
  nats/token; the quoted degenerate replies score -3.5 to -6.2. Fluency's edge is never less than
  `FLUENCY_MIN_MARGIN` (0.5 nats) below its 10th percentile: a confident model's replies cluster
  (Qwen2.5's within 0.1 nats of each other), and so would the edge.
- Relevance also has a chance edge: the 95th percentile of the cosines between base replies and
  the *other* requests of the set (a fluent reply to another question: exactly the off-topic
  failure). A small base is itself off-topic now and then (7% of those 88 replies fall below
  0.27), so from 16 replies relevance's own edge wanders (0.00 +- 0.26 over subsets, useless as a
  bar); the chance edge, from n*(n-1) pairs, holds still (0.27 +- 0.03). The threshold is the
  higher of the two: a reply no closer to its request than to a random other one is off-topic.
  With both, 16 base replies keep 0.90 of themselves and 0.87 of unseen base replies sane. The
  chance edge counts only when it lies below the base's median relevance: where a reply is as
  close to other requests as to its own (an agent's answers to templated tasks, "1404" to "What is
  27 * 52?"; Qwen's base on 12 tool tasks: chance 0.54, own median 0.42, and 7 of its own 12
  replies fell below the edge), relevance cannot tell on- from off-topic there, and the
  percentile edge alone holds.
- A tool call is not prose: relevance and echo are not held against it (a level-0 task asks for
  the very line it gives), and prose replies alone set relevance's range. Fluency, repetition and
  script still apply.
- The high edge of repetition is its 90th percentile raised the same way, but never below 0.25:
  base replies mostly repeat no 3-gram at all (90th percentile 0.04), and a zero ceiling would call
  a reply insane for one repeated phrase. A reply that repeats a quarter of its 3-grams is looping.
The medians are kept beside the thresholds so a report can show where the base sits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from clawr1.quality.measures import Quality

LOW_QUANTILE = 0.10
MARGIN = 1.0
CHANCE_QUANTILE = 0.95
REPETITION_FLOOR = 0.25
# The least room below fluency's 10th percentile, in nats a token. A confident model's replies sit
# close together (Qwen2.5-Coder-0.5B at its recommended sampling, scored at temperature 1: 10th
# percentile -0.70, median -0.60 on 12 probes, so the percentile rule alone put the edge at -0.80,
# and a one-step candidate's fluent replies at -0.82 fell below it), while broken language scores
# a nat or more below the base's typical reply (-1.77 to -2.78 against -1.39 in Qwen's issue).
FLUENCY_MIN_MARGIN = 0.5
MIN_REPLIES = 8


@dataclass(frozen=True)
class Calibration:
    """The normal range of the base model's replies; `to_dict`/`from_dict` for the pool or a JSON file."""

    relevance_min: float
    fluency_min: float
    repetition_max: float
    n: int  # base replies it came from
    relevance_median: float
    fluency_median: float
    repetition_median: float
    relevance_chance: float | None = None  # the chance edge, when other requests' replies were given

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        names = {f.name for f in fields(cls)}
        missing, unknown = names - {"relevance_chance"} - data.keys(), data.keys() - names
        if missing or unknown:
            raise ValueError(f"not a calibration: missing {sorted(missing)}, unknown {sorted(unknown)}")
        return cls(**{k: v if v is None else int(v) if k == "n" else float(v) for k, v in data.items()})


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile with linear interpolation between order statistics (numpy's default)."""
    if not values or not 0 <= q <= 1:
        raise ValueError(f"quantile {q} of {len(values)} values")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (pos - lo) * (ordered[hi] - ordered[lo])


def calibrate(base: Sequence[Quality], chance_relevance: Sequence[float] | None = None,
              low_quantile: float = LOW_QUANTILE, margin: float = MARGIN, chance_quantile: float = CHANCE_QUANTILE,
              repetition_floor: float = REPETITION_FLOOR, min_replies: int = MIN_REPLIES) -> Calibration:
    """The normal range from measured base replies (empty ones are left out: they are never sane).

    Args:
        base: the base model's replies, measured (adapter off) on requests like those it will judge.
        chance_relevance: cosines of base replies with requests they do not answer (`QualityMeter.calibrate`
            computes them); None: no chance edge.
        low_quantile: the percentile of the low edge (and 1 - it for repetition's high edge).
        margin: how far past that percentile is still normal, as a share of its distance to the median.
        chance_quantile: the percentile of `chance_relevance` a relevant reply must reach.
        repetition_floor: the lowest repetition ceiling.
        min_replies: fewer non-empty replies than this raise: the edges would be noise.
    """
    kept = [q for q in base if not q.empty and q.fluency is not None]
    if len(kept) < min_replies:
        raise ValueError(f"calibration needs at least {min_replies} non-empty base replies, got {len(kept)}")
    # Relevance's range is that of prose replies; tool calls are not held to it (`insane_because`).
    rel = [q.relevance for q in kept if not q.tool_call] or [q.relevance for q in kept]
    flu = [q.fluency for q in kept if q.fluency is not None]
    rep = [q.repetition for q in kept]

    def low(values: list[float]) -> tuple[float, float]:
        edge, median = quantile(values, low_quantile), quantile(values, 0.5)
        return edge - margin * (median - edge), median

    rel_min, rel_med = low(rel)
    chance = quantile(chance_relevance, chance_quantile) if chance_relevance else None
    if chance is not None and chance < rel_med:
        rel_min = max(rel_min, chance)
    flu_min, flu_med = low(flu)
    flu_min = min(flu_min, quantile(flu, low_quantile) - FLUENCY_MIN_MARGIN)
    rep_edge, rep_med = quantile(rep, 1 - low_quantile), quantile(rep, 0.5)
    rep_max = max(repetition_floor, rep_edge + margin * (rep_edge - rep_med))
    return Calibration(relevance_min=rel_min, fluency_min=flu_min, repetition_max=rep_max, n=len(kept),
                       relevance_median=rel_med, fluency_median=flu_med, repetition_median=rep_med,
                       relevance_chance=chance)


def insane_because(q: Quality, calibration: Calibration) -> list[str]:
    """Why a reply falls outside the base's normal range (empty list: it is sane)."""
    if q.empty:
        return ["empty"]
    why = []
    if q.relevance < calibration.relevance_min and not q.tool_call:
        why.append(f"relevance {q.relevance:.3f} < {calibration.relevance_min:.3f}")
    if q.fluency is None or q.fluency < calibration.fluency_min:
        shown = "none" if q.fluency is None else f"{q.fluency:.3f}"
        why.append(f"fluency {shown} < {calibration.fluency_min:.3f}")
    if q.repetition > calibration.repetition_max:
        why.append(f"repetition {q.repetition:.3f} > {calibration.repetition_max:.3f}")
    if q.echo:
        why.append("echoes the request")
    if q.refusal:
        why.append("refuses")
    if q.foreign:
        why.append("writes in another script")
    return why


def sane(q: Quality, calibration: Calibration) -> bool:
    """Relevance and fluency within the base's normal range, repetition not above it, not empty."""
    return not insane_because(q, calibration)
