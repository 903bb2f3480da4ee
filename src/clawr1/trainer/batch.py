"""From leased samples to the per-token tensors the objectives take.

The RL advantage of a sample depends on the others (its GRPO group, the reward baseline), so it is
computed once per batch (`rl_advantages`), before the batch is cut into micro-batches (`prepare`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from clawr1.core.config import Config, TrainerConfig, hint_at_for
from clawr1.core.messages import text_of
from clawr1.core.records import Step
from clawr1.trainer.losses import (
    advantage_signs,
    combine_advantage,
    ema_update,
    online_advantages,
    opd_advantage,
    singletons,
)
from clawr1.trainer.policy import Policy, Rows, pack

log = logging.getLogger(__name__)

HINT_PREFIX = "\n\n[Hint from what happened next] "
SYSTEM_HINT_PREFIX = "\n\nWhat happened after an earlier answer, to follow in this one: "


@dataclass
class TrainSample:
    step: Step
    reward: float | None  # the latest reward; None or 0 gives no RL signal
    weight: float = 1.0  # below 1 for stale samples under `stale_policy = "downweight"`
    hint: str | None = None
    lease_id: str | None = None  # the lease it came in (acknowledged after the version trained on it)
    relabelled: bool = False  # a row made from another (`relabelled`, `consolidation`): no lease of its own,
    # behaviour = the learner's
    teacher_prompt: list[int] | None = None  # the teacher's context, when not the prompt with `hint` in it
    memory: tuple[int, ...] = ()  # a `consolidation` row: the memory entries its teacher's prompt carried


def per_sample(samples: list[TrainSample], config: TrainerConfig) -> list[TrainSample]:
    """`trainer.loss_average = "sample"`: each sample's weight times the mean reply length of the
    lease's samples that train (a reward for `rl`, a hint for `opd`, either for `combine`) over its
    own, so the token mean the loss takes becomes a mean over samples (of each one's token mean) at
    the same overall size; an empty reply has no tokens to weigh. `token` leaves them as they are."""
    if config.loss_average == "token":
        return samples

    def trains(s: TrainSample) -> bool:
        return (config.method != "opd" and bool(s.reward)) or (config.method != "rl" and bool(s.hint))

    lengths = [len(s.step.token_ids) for s in samples if trains(s) and s.step.token_ids]
    if not lengths:
        return samples
    mean = sum(lengths) / len(lengths)
    return [replace(s, weight=s.weight * mean / len(s.step.token_ids)) if s.step.token_ids else s for s in samples]


def relabelled(pool: Any, samples: list[TrainSample], weight: float) -> list[TrainSample]:
    """Hindsight relabelling (`trainer.relabel`): for each +1 sample whose previous main turn was
    corrected (it has a hint), one more row: this reply's tokens as the answer to that turn's
    prompt, i.e. to the request before the correction. Its stored logprobs were sampled under the
    correction, so `prepare` takes the learner's own as its behaviour."""
    accepted = [s for s in samples if (s.reward or 0) > 0 and not s.relabelled]
    if not weight or not accepted:
        return []
    before = pool.previous_turns([s.step.step_id for s in accepted])
    corrected = pool.hints(list(before.values()))
    pairs = [(s, before[s.step.step_id]) for s in accepted if before.get(s.step.step_id) in corrected]
    previous = {step.step_id: step for step in pool.get_steps([p for _, p in pairs])} if pairs else {}
    return [TrainSample(replace(s.step, step_id=f"{s.step.step_id}:relabelled", prompt_id=f"{p}:relabelled",
                                messages=previous[p].messages, tools=previous[p].tools,
                                prompt_ids=previous[p].prompt_ids), s.reward, s.weight * weight, relabelled=True)
            for s, p in pairs]


MEMORY_SUFFIX = ":memory"


def load_samples(pool: Any, lease: Any) -> list[TrainSample]:
    """A lease's samples with their rewards and hints, each tagged with the lease: the version that
    trains on them lists it (`lease_ids`) to acknowledge after its checkpoint."""
    if not lease.step_ids:
        return []
    steps = pool.get_steps(lease.step_ids)
    hints = pool.hints(lease.step_ids)
    return [TrainSample(step, sample.reward, sample.weight, hints.get(step.step_id), lease.lease_id)
            for step, sample in zip(steps, lease.samples, strict=True)]


def resolved(config: Config) -> TrainerConfig:
    """The trainer section with what it leaves to the served model filled in (`hint_at`)."""
    tc = config.trainer
    return tc if tc.hint_at else tc.model_copy(update={"hint_at": hint_at_for(config.engine.model)})


def with_hint(messages: list[dict[str, Any]], hint: str, at: str = "user") -> list[dict[str, Any]]:
    """The turn's context as the teacher sees it: the hint appended to the last user message
    (`at="user"`), or to the system prompt (`"system"`; one is added in front when there is none)."""
    out = [dict(m) for m in messages]
    if at == "system":
        if out and out[0].get("role") in ("system", "developer"):
            out[0]["content"] = text_of(out[0].get("content"), "content") + SYSTEM_HINT_PREFIX + hint
            return out
        return [{"role": "system", "content": SYSTEM_HINT_PREFIX.strip() + " " + hint}, *out]
    for message in reversed(out):
        if message.get("role") == "user":
            message["content"] = text_of(message.get("content"), "content") + HINT_PREFIX + hint
            return out
    return out + [{"role": "user", "content": HINT_PREFIX.strip() + " " + hint}]


@dataclass
class Prepared:
    rows: Rows
    behaviour: torch.Tensor  # [B, K] the engine's sampled logprobs, right-aligned
    advantage: torch.Tensor  # [B, K]
    mask: torch.Tensor  # [B, K]: reply tokens of samples with a signal
    sampled: torch.Tensor  # [B, K]: the tokens of `mask` whose behaviour logprob the engine stored
    stats: dict[str, float]  # counts: they add up over micro-batches
    # `opd_estimator = "full"`: the hinted teacher's hidden states [B, K, H] at the reply positions,
    # its LM head, and the weight of each token's KL to it (hinted samples' reply tokens x weight).
    teacher: torch.Tensor | None = None
    teacher_head: torch.Tensor | None = None
    distill: torch.Tensor | None = None
    # `stop_coef > 0`: the hinted teacher's logprob of ending the reply at each reply position
    # [B, K], and the weight of each token's stop term (hinted samples' reply tokens x weight).
    stop_teacher: torch.Tensor | None = None
    stop_weight: torch.Tensor | None = None
    # Consolidation rows: per memory entry, what is left to teach (`memory_gaps`).
    memory_gaps: dict[int, dict[str, Any]] = field(default_factory=dict)


def rl_advantages(samples: list[TrainSample], config: TrainerConfig, baseline: float) -> tuple[torch.Tensor, float]:
    """The RL advantage of each sample of a batch (0 without a reward), and the reward baseline
    after it: GRPO within groups of 2+ (same prompt id); a singleton gets r - baseline (with
    `config.baseline = "ema"`, else r), negatives times `config.negative_weight`. The batch is
    judged against the baseline from before it; then its online rewards, in order, update it."""
    raw = torch.tensor([s.reward or 0.0 for s in samples])
    # A sample without a reward (a hint alone) is no member of its group: counted as a reward of
    # 0, it would move the others' mean and spread (two +1 replies would get +0.7 instead of 0).
    groups = [s.step.prompt_id if raw[i] != 0 else f"\0unrewarded-{i}" for i, s in enumerate(samples)]
    use = baseline if config.baseline == "ema" else 0.0
    advantage = online_advantages(raw, groups, use, config.negative_weight) * (raw != 0)
    if config.baseline == "ema":  # (a relabelled row repeats a reward already counted)
        counted = singletons(groups) & (raw != 0) & ~torch.tensor([s.relabelled for s in samples], dtype=torch.bool)
        baseline = ema_update(baseline, raw[counted], config.baseline_decay)
    return advantage, baseline


def prepare(policy: Policy, samples: list[TrainSample], config: TrainerConfig, rl: torch.Tensor) -> Prepared:
    """Advantages per token for `config.method` (`rl`: each sample's RL advantage, from
    `rl_advantages` over the whole batch); samples without a usable signal are masked."""
    steps = [s.step for s in samples]
    rows = pack([s.prompt_ids for s in steps], [s.token_ids for s in steps], [s.temperature for s in steps],
                policy.pad_id, [(s.top_k, s.top_p) for s in steps])
    k = rows.targets.shape[1]
    behaviour = torch.zeros(len(steps), k)
    own = [i for i, s in enumerate(samples) if s.relabelled]
    for i, step in enumerate(steps):
        if step.logprobs and not samples[i].relabelled:
            behaviour[i, k - len(step.logprobs):] = torch.tensor(step.logprobs)
    if own:  # relabelled rows: sampled in another context, so the learner's logprobs are the reference
        with torch.no_grad():
            mine = policy.logprobs(pack([steps[i].prompt_ids for i in own], [steps[i].token_ids for i in own],
                                        [steps[i].temperature for i in own], policy.pad_id,
                                        [(steps[i].top_k, steps[i].top_p) for i in own]))
        behaviour += _right_aligned(mine.float().cpu(), samples, own, k)
    has_hint = torch.tensor([bool(s.hint) for s in samples])
    opd = torch.zeros(len(steps), k)
    hinted = config.method != "rl" and bool(has_hint.any())
    full = hinted and config.opd_estimator == "full"
    stop = teacher = None
    if hinted and not full:
        opd, stop, teacher = _opd(policy, samples, rows, behaviour, config)
    remembered = [i for i, s in enumerate(samples) if s.memory]
    if remembered and teacher is None:  # (the full estimator reads hidden states, not these logprobs)
        teacher, _ = teacher_logprobs(policy, samples, remembered, k, config)
    advantage, mask, usable = token_advantages(samples, config, rl, opd, rows.mask)
    weight = torch.tensor([s.weight for s in samples])
    has_logprobs = torch.tensor([bool(s.logprobs) and not sample.relabelled for s, sample in zip(steps, samples)])
    stats = {"samples": float(len(samples) - len(own)), "relabelled": float(len(own) - len(remembered)),
             "memory_rows": float(len(remembered)),
             "usable": float(usable.sum()), "tokens": float(mask.sum()),
             "reply_tokens": float(rows.mask.sum()), **advantage_signs(advantage * mask, rows.mask)}
    device = policy.device
    out = Prepared(rows.to(device), behaviour.to(device), advantage.to(device), mask.to(device),
                   (mask * has_logprobs[:, None].float()).to(device), stats)
    if remembered:
        out.memory_gaps = memory_gaps(samples, teacher, behaviour, rows.mask)
    if full:
        out.teacher, out.teacher_head = _teacher_hidden(policy, samples, rows, config)
        out.distill = (mask * (has_hint * weight)[:, None]).to(device)
    if stop is not None:
        out.stop_teacher, out.stop_weight = stop.to(device), (mask * (has_hint * weight)[:, None]).to(device)
    return out


def token_advantages(samples: list[TrainSample], config: TrainerConfig, rl: torch.Tensor, opd: torch.Tensor,
                     reply_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token advantages [B, K] for `config.method`, the mask of the tokens that train (reply
    tokens of samples with a signal) and which samples have one [B]: `rl`, each sample's RL advantage (`rl_advantages`);
    `opd`, the OPD advantage per token (zeros without a hint), right-aligned like `reply_mask`.
    The local trainer and the Tinker backend (`tinker.py`) both take their advantages from here."""
    k = reply_mask.shape[1]
    raw = torch.tensor([s.reward or 0.0 for s in samples])
    has_rl, has_hint = raw != 0, torch.tensor([bool(s.hint) for s in samples])
    if config.method == "rl":
        advantage, usable = rl[:, None].expand(-1, k), has_rl
    elif config.method == "opd":
        advantage, usable = opd, has_hint
    else:
        advantage = combine_advantage(opd, (rl * has_rl)[:, None], config.w_opd, config.w_rl)
        usable = has_rl | has_hint
    weight = torch.tensor([s.weight for s in samples])
    return advantage * weight[:, None], reply_mask * usable[:, None].float(), usable


@contextmanager
def _teacher(policy: Policy, config: TrainerConfig) -> Iterator[None]:
    """The policy's weights as `config.teacher` says: the base, the moving average, or itself."""
    if config.teacher == "base":
        with policy.adapter_off():
            yield
    elif config.teacher == "ema":
        with policy.ema_weights():
            yield
    else:
        yield


def hinted_prompt(chat: Any, step: Step, hint: str, at: str = "user") -> list[int]:
    """The teacher's context (`chat`: the model's `ChatFormat`): the conversation with the hint in
    it; a raw-prompt step (`/v1/completions` stores no messages) gets the hint as a line of text in
    front of its own prompt tokens, so the teacher still sees the request it answers."""
    if step.messages:
        return chat.render(with_hint(step.messages, hint, at), step.tools)
    prompt = list(step.prompt_ids)
    head = prompt[:1] if prompt and prompt[0] == chat.tokenizer.bos_token_id else []  # the hint goes after a BOS
    return head + chat.tokenizer.encode(f"{HINT_PREFIX.strip()} {hint}\n\n", add_special_tokens=False) + prompt[len(head):]


def _teacher_rows(policy: Policy, samples: list[TrainSample], index: list[int], at: str | None) -> Rows:
    """The hinted samples' replies after their hint-augmented contexts (a consolidation row's: the
    prompt as served, memory in it), right-aligned like `pack`."""
    prompts = [samples[i].teacher_prompt if samples[i].teacher_prompt is not None
               else hinted_prompt(policy.chat, samples[i].step, samples[i].hint or "", at) for i in index]
    return pack(prompts, [samples[i].step.token_ids for i in index], [samples[i].step.temperature for i in index],
                policy.pad_id, [(samples[i].step.top_k, samples[i].step.top_p) for i in index])


def _right_aligned(values: torch.Tensor, samples: list[TrainSample], index: list[int], k: int) -> torch.Tensor:
    """Values of the teacher rows ([len(index), kt, ...]) moved to the rows of `samples` they
    belong to ([len(samples), k, ...]), zeros elsewhere: both batches are right-aligned on the
    same reply tokens, so each reply's last columns carry across."""
    out = values.new_zeros((len(samples), k, *values.shape[2:]))
    kt = values.shape[1]
    for j, i in enumerate(index):
        n = len(samples[i].step.token_ids)
        if n:
            out[i, k - n:] = values[j, kt - n:]
    return out


@torch.no_grad()
def teacher_logprobs(policy: Policy, samples: list[TrainSample], index: list[int], k: int, config: TrainerConfig,
                     stop: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The teacher's logprobs [len(samples), k] of the reply tokens of `samples[index]` after their
    teacher contexts (zeros elsewhere), right-aligned on `k` columns; with `stop`, also its logprob
    of ending the reply at each of those positions (same forward), else None."""
    with _teacher(policy, config):
        teacher_rows = _teacher_rows(policy, samples, index, config.hint_at)
        if stop:
            teacher, ends = policy.logprobs_and_stop(teacher_rows)
        else:
            teacher, ends = policy.logprobs(teacher_rows), None
    return (_right_aligned(teacher.cpu(), samples, index, k),
            None if ends is None else _right_aligned(ends.cpu(), samples, index, k))


def _opd(policy: Policy, samples: list[TrainSample], rows: Rows, behaviour: torch.Tensor,
         config: TrainerConfig) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Teacher logprobs of the same reply tokens with the hint in the context, minus behaviour
    (zero on the tokens of samples without a hint); with `stop_coef`, also the teacher's logprob
    of ending the reply at each of those positions (same forward), else None; and the teacher's
    logprobs themselves."""
    index = [i for i, s in enumerate(samples) if s.hint]
    teacher, stop = teacher_logprobs(policy, samples, index, rows.targets.shape[1], config, config.stop_coef > 0)
    hinted = rows.mask * torch.tensor([bool(s.hint) for s in samples])[:, None]
    stop = None if stop is None else stop * hinted
    return opd_advantage(teacher, behaviour, config.opd_clip) * hinted, stop, teacher


def memory_gaps(samples: list[TrainSample], teacher: torch.Tensor, own: torch.Tensor,
                mask: torch.Tensor) -> dict[int, dict[str, Any]]:
    """Per memory entry, what consolidation has left to teach: over the reply tokens (`mask`) of the
    consolidation rows that carry it, the sums of teacher (reminded) minus `own` (the learner, not
    reminded) logprob, the token counts and the step ids. `memory_gap_means` turns them into means."""
    out: dict[int, dict[str, Any]] = {}
    for i, sample in enumerate(samples):
        row = {"gap_sum": float(((teacher[i] - own[i]) * mask[i]).sum()), "tokens": float(mask[i].sum()),
               "steps": [sample.step.step_id.removesuffix(MEMORY_SUFFIX)]}
        add_gaps(out, dict.fromkeys(sample.memory, row))
    return out


def add_gaps(into: dict[int, dict[str, Any]], more: dict[int, dict[str, Any]]) -> None:
    for entry, m in more.items():
        acc = into.setdefault(entry, {"gap_sum": 0.0, "tokens": 0.0, "steps": []})
        acc["gap_sum"] += m["gap_sum"]
        acc["tokens"] += m["tokens"]
        acc["steps"] += m["steps"]


def memory_gap_means(gaps: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """`check_memory`'s form: per entry the mean gap (nats a token), the tokens and the steps."""
    return {entry: {"gap": m["gap_sum"] / m["tokens"], "tokens": int(m["tokens"]), "steps": m["steps"]}
            for entry, m in gaps.items() if m["tokens"]}


@torch.no_grad()
def _teacher_hidden(policy: Policy, samples: list[TrainSample], rows: Rows,
                    config: TrainerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's hidden states [B, K, H] at the reply positions of `rows` (zeros for samples
    without a hint), and its LM head: with them the loss measures KL(policy || teacher) over the
    whole vocabulary at every reply position (`opd_estimator = "full"`)."""
    index = [i for i, s in enumerate(samples) if s.hint]
    with _teacher(policy, config):
        hidden, head = policy.hidden(_teacher_rows(policy, samples, index, config.hint_at)), policy.head.detach()
    return _right_aligned(hidden, samples, index, rows.targets.shape[1]), head


def micro_batches(samples: list[TrainSample], budget: int, max_rows: int) -> list[list[int]]:
    """Indices of `samples` cut into forward/backward passes: sorted by length (less padding), each
    pass at most `max_rows` samples and rows x longest (prompt + reply) within `budget` tokens; a
    sample longer than the budget is a pass of its own."""
    def length(i: int) -> int:
        return len(samples[i].step.prompt_ids) + len(samples[i].step.token_ids)

    out: list[list[int]] = []
    for i in sorted(range(len(samples)), key=length):
        current = out[-1] if out else None
        # Sorted ascending, so sample i is the longest of any pass it joins.
        if current is not None and len(current) < max_rows and (len(current) + 1) * length(i) <= budget:
            current.append(i)
        else:
            out.append([i])
    return out
