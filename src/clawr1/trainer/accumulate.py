"""A version in the making (`Accumulated`: the samples whose gradients the adapter holds, and their
metrics), when it is due, and the learning rate of its step: the bookkeeping of `Trainer.train_step`,
apart from the loop so that the loop reads top to bottom."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from clawr1.core.config import TrainerConfig
from clawr1.trainer.batch import Prepared, TrainSample

# Sums over the hinted tokens only (counted, then divided by their own token count, not by all tokens).
HINTED_SUMS = ("kl_teacher_sum", "distill_tokens", "kl_stop_sum", "stop_tokens", "p_stop_sum", "p_stop_teacher_sum")


@dataclass
class Accumulated:
    """A version in the making: the samples whose gradients the adapter's `.grad` holds since the
    last optimizer step, and their metrics so far."""

    opened: float  # clock() at its first samples: `max_wait_s` counts from here
    samples: list[TrainSample] = field(default_factory=list)
    counts: dict[str, float] = field(default_factory=dict)  # `prepare`'s counts, summed
    sums: dict[str, float] = field(default_factory=dict)  # the loss's metrics times training tokens, summed
    passes: list[Prepared | None] = field(default_factory=list)  # this rank's passes, with `trainer.epochs` > 1
    memory_gaps: dict[int, dict[str, Any]] = field(default_factory=dict)  # this rank's consolidation rows'
    # measure, per memory entry (`batch.memory_gaps`), taken before the step
    prepare_s: float = 0.0
    train_s: float = 0.0

    @property
    def leased(self) -> int:
        """Samples from the pool (not counting the rows `relabelled` made from them)."""
        return sum(not s.relabelled for s in self.samples)

    @property
    def tokens(self) -> float:
        """Training tokens: the denominator of the token mean."""
        return self.counts.get("tokens", 0.0)

    def add(self, metrics: dict[str, float], tokens: float) -> None:
        for key, value in metrics.items():
            self.sums[key] = self.sums.get(key, 0.0) + value * tokens

    def count(self, counts: dict[str, float]) -> None:
        for key, value in counts.items():
            self.counts[key] = self.counts.get(key, 0.0) + value

    def metrics(self) -> dict[str, Any]:
        """Token means of the loss's metrics, the counts, the advantage signs as fractions of the
        reply tokens (a token of a sample without a signal has advantage 0), and the leases."""
        means = {key: value / self.tokens for key, value in self.sums.items()} if self.tokens else {}
        counts, reply = self.counts, max(self.counts.get("reply_tokens", 0.0), 1.0)
        rewarded = [s.reward for s in self.samples if s.reward and not s.relabelled]
        lease_ids = list(dict.fromkeys(s.lease_id for s in self.samples if s.lease_id))
        if counts.get("distill_tokens"):  # KL to the hinted teacher, per hinted token
            means["kl_teacher"] = counts["kl_teacher_sum"] / counts["distill_tokens"]
        if counts.get("stop_tokens"):  # the stop term, and the mean chance of ending, per hinted token
            for key in ("kl_stop", "p_stop", "p_stop_teacher"):
                means[key] = counts[f"{key}_sum"] / counts["stop_tokens"]
        return {"loss": 0.0, "ratio": 0.0, "clip_frac": 0.0, "kl": 0.0, "adv_mean": 0.0, **means,
                "samples": counts.get("samples", 0.0), "relabelled": counts.get("relabelled", 0.0),
                "memory_rows": counts.get("memory_rows", 0.0),
                "usable": counts.get("usable", 0.0), "tokens": self.tokens,
                "adv_pos_frac": counts.get("adv_pos", 0.0) / reply, "adv_neg_frac": counts.get("adv_neg", 0.0) / reply,
                "adv_zero_frac": counts.get("adv_zero", 0.0) / reply,
                "reward_mean": sum(rewarded) / len(rewarded) if rewarded else 0.0,
                "hint_rate": sum(1 for s in self.samples if s.hint and not s.relabelled) / max(self.leased, 1),
                "prepare_s": self.prepare_s, "train_s": self.train_s,
                "tokens_per_s": self.tokens / max(self.prepare_s + self.train_s, 1e-9),
                "lease_ids": lease_ids, "leases": len(lease_ids), "accumulated_s": clock() - self.opened}


def clock() -> float:
    """The trainer's clock (wall time, as the pool's timestamps), read through this one name so that a
    test moves time by replacing it instead of sleeping past `max_wait_s`."""
    return time.time()


def version_due(acc: Accumulated, config: TrainerConfig, lease_seconds: float, now: float | None = None) -> bool:
    """Whether the accumulated version steps now: always without `min_samples`; with it, once it
    has `min_samples` samples, or has been open `max_wait_s`, or half the lease time (its first
    lease must not expire, and its samples come back to be trained twice, while it waits)."""
    if config.min_samples is None:
        return True
    age = (clock() if now is None else now) - acc.opened
    enough = min(config.min_samples, config.batch_size)  # a smaller --batch-size caps the default 8
    return acc.leased >= enough or age >= config.max_wait_s or age >= lease_seconds / 2


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """The steps an optimizer's state has taken (restored with its checkpoint; 0 when fresh)."""
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def scheduled_lr(config: TrainerConfig, step: int) -> float:
    """The learning rate of optimizer step `step` (1, 2, ...): linear warmup over `warmup_steps`,
    then constant."""
    if config.warmup_steps and step < config.warmup_steps:
        return config.lr * step / config.warmup_steps
    return config.lr
