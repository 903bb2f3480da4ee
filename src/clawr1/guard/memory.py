"""Retiring a memory entry on held-out prompts: does the version still need the reminder?

A probe replayed from a turn whose prompt carried a user's memory entries is asked without them
(`probes.probes_of`), so the candidate's reply `y` is what it says unreminded, on a prompt nothing
trained on. The candidate then scores `y` after the prompt as served (the entries in it); its
sampled logprobs are those after the prompt as the client sent it. Their mean difference per token,
log p(y | reminded) - log p(y | unreminded), estimates minus KL(unreminded || reminded) on the
version's own replies: near 0, the reminder no longer changes what it says, and the entry can
leave the prompts (`DataPool.check_memory`, `source="probes"`). The trainer's measure on the
replies it trained on (`trainer/consolidate.py`) only says the weights fit those replies, which
in a demo run retired entries whose preference the weights kept on 0.17-0.42 of new questions.
"""

from __future__ import annotations

import asyncio
from typing import Any

from clawr1.core.types import Generation
from clawr1.guard.probes import Probe


async def probe_gaps(engine: Any, probes: list[Probe], gens: list[Generation], adapter: str | None
                     ) -> dict[int, dict[str, Any]]:
    """Per memory entry the probes carried: the mean gap (nats a token, reminded minus unreminded,
    under the distribution each probe samples from), the reply tokens it was measured on and the
    probes' step ids, as `DataPool.check_memory` takes them. A probe with several entries counts
    for each of them (their reminders are measured together)."""
    jobs = [(p, g) for p, g in zip(probes, gens, strict=True) if p.memory_ids and p.reminded_ids and g.token_ids]

    async def gap(probe: Probe, gen: Generation) -> list[float]:
        if probe.temperature > 0:  # the reply's own logprobs are the unreminded side, exactly (`score`'s contract)
            settings = {"temperature": probe.temperature, "top_k": probe.top_k, "top_p": probe.top_p}
            reminded = await engine.score(probe.reminded_ids, list(gen.token_ids), adapter=adapter, **settings)
            return [a - b for a, b in zip(reminded, gen.logprobs, strict=True)]
        # greedy: a point mass; both sides under the model's own distribution
        reminded, plain = await asyncio.gather(engine.score(probe.reminded_ids, list(gen.token_ids), adapter=adapter),
                                               engine.score(probe.prompt_ids, list(gen.token_ids), adapter=adapter))
        return [a - b for a, b in zip(reminded, plain, strict=True)]

    diffs = await asyncio.gather(*(gap(p, g) for p, g in jobs))
    sums: dict[int, dict[str, Any]] = {}
    for (probe, _), d in zip(jobs, diffs):
        for entry in probe.memory_ids:
            into = sums.setdefault(entry, {"total": 0.0, "tokens": 0, "steps": []})
            into["total"] += sum(d)
            into["tokens"] += len(d)
            into["steps"].append(probe.step_id)
    return {entry: {"gap": m["total"] / m["tokens"], "tokens": m["tokens"], "steps": m["steps"]}
            for entry, m in sums.items() if m["tokens"]}
