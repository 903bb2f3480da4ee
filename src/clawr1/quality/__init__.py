"""Reply quality beside every learning number, and the sanity test a guard rejects degenerate
versions with: relevance (MiniLM cosine with the request), base-model fluency, word 3-gram
repetition, and drift from the base (KL and entropy per token), judged against the base model's
own normal range. See `measures.py` for the measures, `calibration.py` for the range."""

from clawr1.quality.calibration import Calibration, calibrate, insane_because, quantile, sane
from clawr1.quality.measures import (
    Quality,
    Reply,
    entropy_estimate,
    fluency,
    kl_estimate,
    repetition,
    request_text,
)
from clawr1.quality.meter import QualityMeter
from clawr1.quality.summary import Summary, Verdict, not_worse, summarize

__all__ = [
    "Calibration", "Quality", "QualityMeter", "Reply", "Summary", "Verdict", "calibrate", "entropy_estimate",
    "fluency", "insane_because", "kl_estimate", "not_worse", "quantile", "repetition", "request_text", "sane",
    "summarize",
]
