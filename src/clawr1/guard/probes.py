"""The probe set: held-out requests from recent traffic that every candidate version answers.

A probe is a recorded main turn that nothing has trained on yet, taken out of training
(`DataPool.hold_out`, reason `probe`): its prompt token ids are replayed exactly, with its sampling
temperature and a fixed seed per probe, so two versions asked the same probe set are compared
pairwise. The base model answers the set once when it is drawn; its replies give the calibration
(the base's normal range of each quality measure) and the base summary. Every probe reply is
recorded as a side turn (session `probe:<adapter>:<label>`), so anyone can read what each
candidate said; side turns are never trained on.
"""

from __future__ import annotations

import asyncio
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

from clawr1.core.memory import without
from clawr1.core.records import Step
from clawr1.core.types import Generation, SamplingDefaults, SamplingParams
from clawr1.quality import Calibration, Reply, Summary, summarize

MIN_PROBES = 8  # the calibration's minimum
# Everyday requests for when traffic is too thin to hold out a whole probe set in time (asked in
# the context of the latest traffic's system prompt): they test sanity, not the traffic's tasks.
EVERYDAY = (
    "How do I keep basil fresh after buying it?", "What is a good way to start journaling?",
    "How can I make my small apartment feel bigger?", "What should I check before buying a used bike?",
    "How do I politely end a long phone call?", "What is an easy dinner for a busy weeknight?",
    "How can I stop procrastinating on chores?", "How do I get a stuck jar lid open?",
    "What should I bring to a picnic in the park?", "How do I clean a smelly water bottle?",
    "How can I keep my hands warm when cycling in winter?", "What is a simple way to learn to juggle?",
    "How do I prepare for my first day at a new job?", "How often should I change my toothbrush?",
    "What is a good way to remember a shopping list?", "How do I fix a zipper that keeps coming apart?",
)


@dataclass(frozen=True)
class Probe:
    step_id: str  # the held-out main turn it replays
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    temperature: float
    max_tokens: int
    seed: int
    top_p: float = 1.0  # with `top_k`: sampled as the replayed turn was (the users' settings)
    top_k: int = 0
    # A turn whose prompt carried memory entries is asked without them; these keep the ids of the
    # entries and the prompt as served, so the guard can measure what each reminder still changes.
    memory_ids: tuple[int, ...] = ()
    reminded_ids: list[int] | None = None


@dataclass
class ProbeSet:
    number: int  # 1, 2, ...: a new set (and calibration) every `guard.refresh_versions` versions
    probes: list[Probe]
    calibration: Calibration
    base: Summary  # the base model's own replies, on this set
    drawn_at_version: int
    summaries: dict[int, Summary] = field(default_factory=dict)  # version -> its replies on this set


def probes_of(steps: list[Step], max_tokens: int, render: Any = None) -> list[Probe]:
    """Probes from held-out steps; the seed is a function of the step id, so re-asking is paired.
    A step with no user message (an agent's turn on its system prompt alone) is no probe: a
    reply's relevance is measured against what the user asked. A step whose prompt carried a
    user's memory is asked as its client sent it (`core.memory.without`, rendered by `render`):
    the guard measures what a version says unreminded, and no user's entries reach a probe (nor,
    through its system prompt, the everyday probes)."""
    out = []
    for step in steps:
        if not any(m.get("role") == "user" for m in step.messages or ()):
            continue
        messages, prompt_ids, memory_ids, reminded = step.messages, step.prompt_ids, (), None
        if render is not None and (step.memory or {}).get("entries"):
            messages = without(step.messages, step.memory)
            prompt_ids, reminded = render(messages, step.tools), list(step.prompt_ids)
            memory_ids = tuple(int(e["id"]) for e in step.memory["entries"])
        out.append(Probe(step.step_id, messages, step.tools, prompt_ids, step.temperature,
                         max_tokens, zlib.crc32(step.step_id.encode()), step.top_p, step.top_k,
                         memory_ids, reminded))
    return out


def everyday_probes(render: Any, context: list[dict[str, Any]], n: int, max_tokens: int,
                    sampling: SamplingDefaults) -> list[Probe]:
    """`n` built-in probes, each an everyday question after `context` (the system messages of recent
    traffic, so the model is tested in the role it serves), sampled as a request that names no
    settings is (`sampling`: the gateway's defaults)."""
    probes = []
    for i, question in enumerate(EVERYDAY[:n]):
        messages = [*context, {"role": "user", "content": question}]
        probes.append(Probe(f"builtin-{i}", messages, None, render(messages, None), sampling.temperature,
                            max_tokens, zlib.crc32(question.encode()), sampling.top_p, sampling.top_k))
    return probes


async def ask(engine: Any, pool: Any, probes: list[Probe], adapter: str | None, tenant: str, label: str) -> list[Generation]:
    """Every probe answered by `adapter` (None: the base), recorded as side turns."""
    streams = [engine.generate(p.prompt_ids, SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature,
                                                            seed=p.seed, top_p=p.top_p, top_k=p.top_k), adapter)
               for p in probes]
    gens: list[Generation] = list(await asyncio.gather(*[s.final() for s in streams]))
    session = f"probe:{adapter or 'base'}:{label}"
    tag = uuid.uuid4().hex[:8]
    for i, (probe, gen) in enumerate(zip(probes, gens)):
        pool.submit_step(Step(
            step_id=f"probe-{tag}-{i}", tenant=tenant, session_id=session, prompt_id=session, turn_index=i,
            turn_type="side", messages=probe.messages, tools=probe.tools, prompt_ids=gen.prompt_ids,
            token_ids=gen.token_ids, logprobs=gen.logprobs, text=gen.text, policy_version=gen.version,
            adapter=gen.adapter, finish_reason=gen.finish_reason or "aborted", temperature=gen.temperature,
            top_p=gen.top_p, top_k=gen.top_k, timings={}))
    return gens


def replies_of(probes: list[Probe], gens: list[Generation], engine: Any) -> list[Reply]:
    """The probe replies as the meter measures them, parsed by `engine`: a probe replayed from an
    agent's turn may be answered with a tool call, measured as one."""
    return [Reply.from_generation(p.messages, g, parse=engine.parse, tools=p.tools) for p, g in zip(probes, gens)]


async def measure(meter: Any, probes: list[Probe], gens: list[Generation], calibration: Calibration) -> Summary:
    return summarize(await meter.measure(replies_of(probes, gens, meter.engine)), calibration)
