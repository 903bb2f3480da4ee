"""Per-user memory into the weights (context distillation), and entries retired once learned.

A step whose prompt carried memory entries (`Step.memory`, `core/memory.py`) also trains as one
more row (`rows`): the same reply after the prompt as the client sent it, taught through OPD by the
prompt as served. The same rows measure, per entry, what is left to teach (`batch.memory_gaps`);
after each verdict `check` records those measures, measures retired entries again on the steps
they retired on, and the pool restores entries from both; it retires them from the trained rows
only with the guard off (with it on, on the guard's held-out probes: `guard/memory.py`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from clawr1.core.config import Config, TrainerConfig
from clawr1.core.memory import without
from clawr1.trainer.batch import MEMORY_SUFFIX, TrainSample, memory_gap_means, memory_gaps, teacher_logprobs
from clawr1.trainer.policy import Policy, pack

log = logging.getLogger(__name__)


def rows(chat: Any, samples: list[TrainSample], weight: float) -> list[TrainSample]:
    """Context distillation of per-user memory (`memory.distill_weight`): for each sample whose
    prompt carried memory entries, one more row: the same reply tokens after the prompt without
    them (`core.memory.without`, rendered by `chat`), taught by the prompt as served. OPD then
    pulls the student, who is not reminded, towards what the teacher says when reminded; the
    sample itself keeps its recorded prompt (memory included) for RL. A step whose messages do not
    hold the memory its record names is left out, with a warning (it would teach nonsense)."""
    out = []
    for s in samples if weight else ():
        record = s.step.memory or {}
        if not record.get("entries") or not s.step.messages or s.relabelled or not s.step.token_ids:
            continue
        try:
            messages = without(s.step.messages, record)
        except ValueError as exc:
            log.warning("step %s: no consolidation row: %s", s.step.step_id, exc)
            continue
        out.append(TrainSample(
            replace(s.step, step_id=s.step.step_id + MEMORY_SUFFIX, prompt_id=s.step.prompt_id + MEMORY_SUFFIX,
                    messages=messages, prompt_ids=chat.render(messages, s.step.tools)),
            None, s.weight * weight, hint=record["added"], relabelled=True, teacher_prompt=list(s.step.prompt_ids),
            memory=tuple(int(e["id"]) for e in record["entries"])))
    return out


def recheck(policy: Policy, pool: Any, config: Config, tc: TrainerConfig, tenant: str | None) -> dict[int, dict[str, Any]]:
    """The consolidation measure of retired entries (the longest unchecked first, at most
    `memory.recheck_entries`) with the weights as they are, on the steps each retired on: teacher
    (reminded) minus the version (not reminded), no gradient."""
    mc = config.memory
    due = pool.memory_recheck(tenant, mc.recheck_entries) if mc.recheck_entries and mc.distill_weight else []
    wanted = list(dict.fromkeys(step_id for entry in due for step_id in entry["steps"]))
    if not wanted:
        return {}
    steps = {step.step_id: step for step in pool.get_steps(wanted)}
    measured = [replace(row, memory=(entry["id"],))  # a step may carry several entries: measure the one due
                for entry in due for step_id in entry["steps"] if step_id in steps
                for row in rows(policy.chat, [TrainSample(steps[step_id], None)], 1.0)]
    if not measured:
        return {}
    packed = pack([r.step.prompt_ids for r in measured], [r.step.token_ids for r in measured],
                  [r.step.temperature for r in measured], policy.pad_id,
                  [(r.step.top_k, r.step.top_p) for r in measured])
    with torch.no_grad():
        own = policy.logprobs(packed).float().cpu()
    teacher, _ = teacher_logprobs(policy, measured, list(range(len(measured))), packed.targets.shape[1], tc)
    return memory_gap_means(memory_gaps(measured, teacher, own, packed.mask.float()))


def check(policy: Policy, pool: Any, config: Config, tc: TrainerConfig, tenant: str | None,
          gaps: dict[int, dict[str, Any]], measured_on: int, served: int) -> dict[str, list[int]]:
    """After a verdict: record the measure the version's rows gave (`gaps`, taken with the weights
    of `measured_on`, the version served while they trained) and, with the weights now served
    (`served`), the measure of retired entries (`recheck`); the pool retires and restores entries
    from them. Returns the ids `retired` and `restored`."""
    mc = config.memory
    out: dict[str, list[int]] = {"retired": [], "restored": []}
    # With the guard on, an entry retires on its probes (held-out prompts the version answered
    # unreminded: `guard.memory`), not on the replies it trained on; the trained rows' measure is
    # then recorded beside it. A retired entry's recheck can still restore it.
    for version, measured, retire in ((measured_on, memory_gap_means(gaps), not config.guard.enabled),
                                      (served, recheck(policy, pool, config, tc, tenant), False)):
        if measured:
            for key, ids in pool.check_memory(version, measured, mc.retire_gap, mc.return_gap,
                                              mc.retire_min_tokens, retire=retire).items():
                out[key] += ids
    if out["retired"] or out["restored"]:
        log.info("memory: v%d retired entries %s (the weights learned them), restored %s (forgotten)",
                 served, out["retired"], out["restored"])
    return out
