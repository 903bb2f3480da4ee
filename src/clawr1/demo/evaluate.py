"""Held-out evaluation of whatever version the gateway serves now, paired with the base model.

Each (question, user) pair is asked twice through the gateway: of the served version and of the
base (`X-Policy-Version: 0`), both as *side* turns (`X-Turn-Type: side`: recorded, never trained,
so measuring never teaches the model the test), with the same seed. The served replies are then
measured with `POST /v1/quality` against the base replies to the same prompts, so each reply is
not only checked for the user's preference but also called sane or not by the base's own range.

A preference score alone can reach 1.00 on nonsense ("You're right."), so the headline is the
share of replies that keep the preference *and* are sane; the users themselves never count a
non-answer as preferred either (`questions.non_answer`). Every reply is kept verbatim with its
flags and reasons, so anyone can read what a score was made of.

When the served version is the base (before any training), its replies are the base replies (same
prompts, seeds and version) and are not asked twice; a later evaluation can reuse them
(`reference=`), which makes the base replies the "before" numbers.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import openai

from clawr1.demo.questions import substantive
from clawr1.demo.users import HELD_OUT, SimulatedUser
from clawr1.quality.calibration import MIN_REPLIES

BASE = "clawr1-v0"


@dataclass(frozen=True)
class EvalReply:
    """One held-out reply, verbatim, with what the user and the quality measure made of it."""

    question: str
    user: str
    preference: str
    completion_id: str
    version: str  # system_fingerprint
    text: str
    finished: bool
    preferred: bool
    non_answer: str | None
    substantive: bool = False
    """It answers and says something the question did not (`questions.substantive`)."""
    sane: bool | None = None  # None: not measured
    reasons: list[str] = field(default_factory=list)
    relevance: float | None = None
    fluency: float | None = None
    repetition: float | None = None
    kl: float | None = None

    @property
    def words(self) -> int:
        return len(self.text.split())


def stats(replies: Sequence[EvalReply]) -> dict[str, Any]:
    """Preference score, sane rate, preferred-and-sane rate, mean relevance / fluency / KL and words
    over `replies` (quality numbers are None when the replies were not measured)."""
    n = len(replies)
    measured = [r for r in replies if r.sane is not None]

    def mean(values: list[float | None]) -> float | None:
        kept = [v for v in values if v is not None]
        return sum(kept) / len(kept) if kept else None

    per_pref: dict[str, list[bool]] = collections.defaultdict(list)
    for r in replies:
        per_pref[r.preference].append(r.preferred)
    return {
        "n": n, "score": sum(r.preferred for r in replies) / n,
        "sane_rate": sum(bool(r.sane) for r in measured) / n if measured else None,
        "preferred_and_sane": sum(r.preferred and bool(r.sane) for r in measured) / n if measured else None,
        "relevance": mean([r.relevance for r in measured]), "fluency": mean([r.fluency for r in measured]),
        "kl": mean([r.kl for r in measured]), "mean_words": sum(r.words for r in replies) / n,
        "answered": sum(r.non_answer is None for r in replies) / n,
        # Stricter: the reply adds a topic word the question did not say, so naming its nouns back
        # in a polite sentence does not count. The headline beside it, with every check at once.
        "substantive": sum(r.substantive for r in replies) / n,
        "preferred_sane_substantive": sum(r.preferred and bool(r.sane) and r.substantive for r in measured) / n
        if measured else None,
        "by_preference": {k: sum(v) / len(v) for k, v in sorted(per_pref.items())},
        "versions": dict(collections.Counter(r.version for r in replies)),
    }


@dataclass(frozen=True)
class EvalResult:
    """The served version's replies and the base's to the same prompts, measured."""

    served: list[EvalReply]
    base: list[EvalReply]
    calibration: dict[str, Any] | None
    quality_error: str | None = None
    """Why the replies could not be measured (too few base replies), None when they were."""

    @property
    def score(self) -> float:
        return stats(self.served)["score"]

    def as_dict(self) -> dict[str, Any]:
        """The served version's numbers at the top (and per version served, as `by_version`), the
        base's under `base`, and every reply verbatim."""
        by_version = collections.defaultdict(list)
        for r in self.served:
            by_version[r.version].append(r)
        return {**stats(self.served), "by_version": {v: stats(rs) for v, rs in sorted(by_version.items())},
                "base": stats(self.base), "calibration": self.calibration, "quality_error": self.quality_error,
                "replies": [asdict(r) for r in self.served], "base_replies": [asdict(r) for r in self.base]}


def sampled(temperature: float | None) -> dict[str, float]:
    """A client's sampling fields: none at all when it sets none (the gateway then applies the model's)."""
    return {} if temperature is None else {"temperature": temperature}


async def evaluate(client: Any, users: list[SimulatedUser], *, max_tokens: int, temperature: float | None,
                   questions: Sequence[str] = HELD_OUT, concurrency: int = 8, seed: int = 0,
                   reference: EvalResult | None = None, named: bool = False, on_base: bool = False) -> EvalResult:
    """Ask every held-out question once per user of the served version and of the base, and
    measure both (`client`: an `openai.AsyncOpenAI` on the gateway). `reference`: an earlier
    evaluation on the same pairs whose base replies are reused instead of asked again. `named`:
    the served version is asked as each user (`X-User-Id`: the user's memory applies); the base
    never is (`X-Memory: off`: its replies are the reference the quality is measured against).
    `on_base`: the "served" replies come from the base weights too (`X-Policy-Version: 0`), with
    the users' memory when `named`: what the memory alone does."""
    pairs = [(u, q) for q in questions for u in users]
    served = await _ask(client, pairs, max_tokens, temperature, seed, concurrency, base=False, named=named,
                        on_base=on_base)
    calibration = None
    if reference is not None:
        if [(r.question, r.user) for r in reference.base] != [(q, u.name) for u, q in pairs]:
            raise ValueError("the reference evaluation asked other (question, user) pairs")
        base, calibration = reference.base, reference.calibration
    elif all(r.version == BASE for r in served) and not named:
        base = served  # same prompts, seeds and version: these are the base's replies
    else:
        base = await _ask(client, pairs, max_tokens, temperature, seed, concurrency, base=True)
    if len(base) < MIN_REPLIES:
        return EvalResult(served, base, None, f"quality needs at least {MIN_REPLIES} base replies, got {len(base)}")
    try:
        if calibration is None:
            served_is_base = base is served
            base, calibration = await _measure(client, base, base)
            served = base if served_is_base else served
        if served[0].sane is None:
            served, calibration = await _measure(client, served, base)
    except openai.BadRequestError as exc:  # e.g. fewer than 8 non-empty base replies: no range to judge by
        return EvalResult(served, base, None, f"replies not measured: {exc.message}")
    return EvalResult(served, base, calibration)


async def quality(client: Any, completion_ids: list[str], reference_ids: list[str]) -> dict[str, Any]:
    """`POST /v1/quality` through the OpenAI client (its base URL, key and error types)."""
    return await client.post("/quality", body={"completion_ids": completion_ids, "reference_ids": reference_ids},
                             cast_to=dict)


async def _measure(client: Any, replies: list[EvalReply],
                   base: list[EvalReply]) -> tuple[list[EvalReply], dict[str, Any]]:
    """The replies with their measures and verdicts, and the calibration they were judged by."""
    answer = await quality(client, [r.completion_id for r in replies], [r.completion_id for r in base])
    measured = [replace(r, sane=m["sane"], reasons=list(m["reasons"]), relevance=m["relevance"], fluency=m["fluency"],
                        repetition=m["repetition"], kl=m["kl"]) for r, m in zip(replies, answer["data"])]
    return measured, answer["calibration"]


async def _ask(client: Any, pairs: list[tuple[SimulatedUser, str]], max_tokens: int, temperature: float | None, seed: int,
               concurrency: int, *, base: bool, named: bool = False, on_base: bool = False) -> list[EvalReply]:
    gate = asyncio.Semaphore(concurrency)
    # Not asked as a user: no memory at all, whatever `memory.fallback` would make of the request.
    headers = ({"X-Turn-Type": "side"} | ({} if named and not base else {"X-Memory": "off"})
               | ({"X-Policy-Version": "0"} if base or on_base else {}))

    async def one(i: int, user: SimulatedUser, question: str) -> EvalReply:
        async with gate:
            response = await client.chat.completions.create(
                model="clawr1", max_tokens=max_tokens, seed=seed * 10_000 + i, **sampled(temperature),
                messages=[{"role": "system", "content": user.system}, {"role": "user", "content": question}],
                extra_headers=headers | ({"X-User-Id": user.name} if named and not base else {}))
        choice = response.choices[0]
        text, finished = choice.message.content or "", choice.finish_reason == "stop"
        verdict = user.assess(question, text, finished)
        return EvalReply(question=question, user=user.name, preference=user.preference.name,
                         completion_id=response.id, version=response.system_fingerprint or "", text=text,
                         finished=finished, preferred=verdict.preferred, non_answer=verdict.non_answer,
                         substantive=verdict.non_answer is None and substantive(question, text))

    return list(await asyncio.gather(*(one(i, u, q) for i, (u, q) in enumerate(pairs))))
