"""Quality over a set of replies, and the paired verdict the guard promotes or rejects with.

The summary is what stands beside every learning number: a preference score of 1.00 reads
differently next to a sane rate of 0.10. `preferred_and_sane` is the honest version of the
preference score: a reply only counts when it keeps the preference *and* is a sane answer.

The verdict is deliberately simple and one-sided: a candidate passes when its sane rate is not
lower than the reference's (incumbent or base, on the same prompts with the same seeds) by more
than `bound`, and, when a maximum is given, its KL from the base per token is under it. A better
candidate always passes; the guard decides what to do with a pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from clawr1.quality.calibration import Calibration, sane
from clawr1.quality.measures import Quality, mean


@dataclass(frozen=True)
class Summary:
    """Means over a set of replies. Fluency's, KL's and entropy's means leave out replies with no
    tokens (an empty reply has none of them; None: no reply had tokens); `kl`/`entropy` are None
    unless every reply with tokens had behaviour logprobs; `preferred_and_sane` is None without
    preference flags."""

    n: int
    relevance: float
    fluency: float | None
    repetition: float
    sane_rate: float
    kl: float | None = None
    entropy: float | None = None
    preferred_and_sane: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Verdict:
    """The guard's answer: `ok` and the reason in words (kept with the decision, shown to people)."""

    ok: bool
    reason: str


def summarize(qualities: Sequence[Quality], calibration: Calibration,
              preferred: Sequence[bool] | None = None) -> Summary:
    """Summarise measured replies; `preferred[i]`: whether reply i kept the learned preference."""
    if not qualities:
        raise ValueError("a summary needs at least one reply")
    if preferred is not None and len(preferred) != len(qualities):
        raise ValueError(f"{len(qualities)} replies but {len(preferred)} preference flags")
    is_sane = [sane(q, calibration) for q in qualities]
    scored = [q.fluency for q in qualities if q.fluency is not None]
    spoke = [q for q in qualities if q.n_tokens]  # an empty reply has no token to measure drift on
    drift = bool(spoke) and all(q.kl is not None and q.entropy is not None for q in spoke)
    return Summary(
        n=len(qualities),
        relevance=mean([q.relevance for q in qualities]),
        fluency=mean(scored) if scored else None,
        repetition=mean([q.repetition for q in qualities]),
        sane_rate=sum(is_sane) / len(qualities),
        kl=mean([q.kl for q in spoke if q.kl is not None]) if drift else None,
        entropy=mean([q.entropy for q in spoke if q.entropy is not None]) if drift else None,
        preferred_and_sane=(sum(p and s for p, s in zip(preferred, is_sane)) / len(qualities)
                            if preferred is not None else None),
    )


def not_worse(candidate: Summary, reference: Summary, bound: float = 0.1, max_kl: float | None = None) -> Verdict:
    """Is the candidate not worse than the reference beyond `bound`? Both summaries must be of the
    same prompts (paired); `max_kl` (nats per token) needs the candidate's KL."""
    if candidate.n != reference.n:
        raise ValueError(f"a paired comparison needs the same prompts: {candidate.n} vs {reference.n} replies")
    if not 0 <= bound <= 1:
        raise ValueError(f"bound is a difference of rates, in [0, 1], got {bound}")
    drop = reference.sane_rate - candidate.sane_rate
    failures = []
    sane_text = f"sane rate {candidate.sane_rate:.2f} vs {reference.sane_rate:.2f}"
    if drop > bound + 1e-12:
        failures.append(f"{sane_text}: {drop:.2f} lower, past the bound {bound:.2f}")
    kl_text = ""
    if max_kl is not None:
        if candidate.kl is None:
            raise ValueError("max_kl needs the candidate's KL: measure replies with their behaviour logprobs")
        kl_text = f"KL {candidate.kl:.3f} nats/token (max {max_kl:.3f})"
        if candidate.kl > max_kl:
            failures.append(kl_text)
    if failures:
        return Verdict(False, "worse: " + "; ".join(failures))
    return Verdict(True, "not worse: " + ", ".join(filter(None, [f"{sane_text} (bound {bound:.2f})", kl_text])))
