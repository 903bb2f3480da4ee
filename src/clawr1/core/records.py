"""The data pool's records: what the gateway writes, the reward stage adds, and the trainer leases.

Plain dataclasses validated on construction, so a malformed record fails where it is made, not
in the trainer hours later. A `Step` is token-faithful: `token_ids[i]` was sampled with behaviour
logprob `logprobs[i]` by `policy_version`; the two lists must line up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

TurnType = Literal["main", "side"]
SampleStatus = Literal["pending", "ready", "leased", "consumed", "dropped"]
SAMPLE_STATUSES: tuple[SampleStatus, ...] = ("pending", "ready", "leased", "consumed", "dropped")
DEFAULT_TENANT = "default"
POLICY = "policy"  # the adapter the trainer publishes and the gateway serves


def adapter_name(tenant: str | None) -> str:
    """The served LoRA adapter: the shared `policy`, or `policy-<tenant>` with per-tenant adapters."""
    return POLICY if tenant is None else f"{POLICY}-{tenant}"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class Step:
    """One served model call, as the trainer will see it.

    `step_id` is chosen by the client or gateway and is the idempotency key: a replayed step is
    stored once. `prompt_id` groups samples of the same prompt (GRPO groups in white-box mode).
    `messages` are the request's messages as served (as sent, plus the memory the gateway added:
    `memory` below). `next_state` is never written by callers: the
    pool fills it on read once the session's next main turn has arrived (that turn's messages
    after this turn's reply: user text, tool results, each with its role). `memory`: whose memory
    the prompt carried, which entries and the exact text they added to `messages`
    (`clawr1/core/memory.py`: `record`, and `without` for the messages the client sent); None when
    the request named no user (or had the memory off).
    """

    step_id: str
    tenant: str
    session_id: str
    prompt_id: str
    turn_index: int
    turn_type: TurnType
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    policy_version: int
    adapter: str | None
    finish_reason: str
    temperature: float
    top_p: float = 1.0  # with `top_k`: how the sampling distribution was cut (`engine/sampling.py`)
    top_k: int = 0
    created_at: float = field(default_factory=time.time)
    timings: dict[str, float] = field(default_factory=dict)
    next_state: list[dict[str, Any]] | None = None
    memory: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("step_id", "session_id", "prompt_id", "tenant"):
            _require(bool(getattr(self, name)), f"Step.{name} must be a non-empty string")
        _require(self.turn_type in ("main", "side"), f"Step.turn_type must be main|side, got {self.turn_type!r}")
        _require(self.turn_index >= 0, f"Step.turn_index must be >= 0, got {self.turn_index}")
        _require(self.policy_version >= 0, f"Step.policy_version must be >= 0, got {self.policy_version}")
        # Token faithfulness: the trainer's importance ratio pairs each token with its logprob.
        _require(len(self.token_ids) == len(self.logprobs),
                 f"Step {self.step_id}: {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs")


@dataclass(frozen=True)
class SessionEvent:
    """A lifecycle event of a session (`close`, `mask`, ...), kept in the append-only log."""

    session_id: str
    kind: str
    tenant: str = DEFAULT_TENANT
    data: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Reward:
    """A score for one step, with the evidence and votes that produced it, so anyone can see why.

    `source` names the producer: `judge`, `env`, `feedback`, `outcome`, ... The latest reward of a
    step is the one its sample trains with (explicit feedback arrives after the judge and wins).
    """

    step_id: str
    score: float
    source: str
    votes: list[float] = field(default_factory=list)
    evidence: str = ""
    created_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        _require(-1.0 <= self.score <= 1.0, f"Reward.score must be in [-1, 1], got {self.score}")
        _require(bool(self.source), "Reward.source must be a non-empty string")


@dataclass(frozen=True)
class Hint:
    """A textual correction extracted from a step's next state (for on-policy distillation)."""

    step_id: str
    text: str
    source: str
    created_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        _require(bool(self.text.strip()), "Hint.text must not be empty")


@dataclass(frozen=True)
class Sample:
    """A main-turn step's place in the training queue.

    `weight` scales its loss (below 1 for stale samples under `downweight`); `reason` says why it
    was dropped or down-weighted; `reward` is its latest reward score.
    """

    step_id: str
    policy_version: int
    status: SampleStatus
    weight: float = 1.0
    reward: float | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Lease:
    """Samples handed to a trainer until `expires_at` (epoch seconds). Ack to consume them; an
    expired lease's samples return to READY, so a trainer crash neither loses nor duplicates."""

    lease_id: str
    step_ids: tuple[str, ...]
    expires_at: float
    samples: tuple[Sample, ...] = ()

    def __len__(self) -> int:
        return len(self.step_ids)
