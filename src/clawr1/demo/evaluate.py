"""Preference score of whatever version the gateway serves now, on held-out prompts.

Requests go through the gateway as *side* turns (`X-Turn-Type: side`): recorded, never trained, so
measuring never teaches the model the test. Each (question, user) pair has a fixed seed, so two
evaluations of different versions are paired: the same prompts sampled with the same seeds.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import Any

from clawr1.demo.users import HELD_OUT, SimulatedUser


@dataclass(frozen=True)
class EvalResult:
    score: float
    n: int
    versions: dict[str, int]  # system_fingerprint -> replies it served
    by_preference: dict[str, float]
    mean_words: float

    def as_dict(self) -> dict[str, Any]:
        return {"score": self.score, "n": self.n, "versions": self.versions, "by_preference": self.by_preference,
                "mean_words": self.mean_words}


async def evaluate(client: Any, users: list[SimulatedUser], *, max_tokens: int, temperature: float,
                   questions: tuple[str, ...] = HELD_OUT, concurrency: int = 8, seed: int = 0) -> EvalResult:
    """Ask every held-out question once per user (`client`: an `openai.AsyncOpenAI`)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, user: SimulatedUser, question: str) -> tuple[str, bool, str, int]:
        async with gate:
            response = await client.chat.completions.create(
                model="clawr1", max_tokens=max_tokens, temperature=temperature, seed=seed * 10_000 + i,
                messages=[{"role": "system", "content": user.system}, {"role": "user", "content": question}],
                extra_headers={"X-Turn-Type": "side"})
        choice = response.choices[0]
        text = choice.message.content or ""
        kept = user.preference.check(text, choice.finish_reason == "stop")
        return user.preference.name, kept, response.system_fingerprint or "", len(text.split())

    pairs = [(u, q) for q in questions for u in users]
    results = await asyncio.gather(*(one(i, u, q) for i, (u, q) in enumerate(pairs)))
    per_pref: dict[str, list[bool]] = collections.defaultdict(list)
    for name, kept, _, _ in results:
        per_pref[name].append(kept)
    return EvalResult(score=sum(k for _, k, _, _ in results) / len(results), n=len(results),
                      versions=dict(collections.Counter(v for _, _, v, _ in results)),
                      by_preference={k: sum(v) / len(v) for k, v in sorted(per_pref.items())},
                      mean_words=sum(w for *_, w in results) / len(results))
