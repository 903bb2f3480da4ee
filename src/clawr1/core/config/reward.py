"""The reward stage's settings (judge, votes, hints) and the guard's."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from clawr1.core.config._base import _Section


class RewardConfig(_Section):
    judge: Literal["auto", "llm", "classifier"] = "auto"
    """Who scores a turn from its next state (rule evidence always comes first): `llm` asks a chat
    model (`judge_url`, else the embedded model with the adapter off); `classifier` uses a small
    embedding classifier that runs here without a hub download; `auto` = `llm` when `judge_url`
    is set, else `classifier` when its package is installed, else `llm` on the embedded model."""

    judge_url: str | None = Field(None, min_length=1, max_length=4096)
    """Base URL of an OpenAI-compatible server for the LLM judge (e.g. `http://host:8000/v1`);
    unset = the embedded model with the adapter disabled."""

    judge_api_key: str | None = Field(None, min_length=1, max_length=4096)
    """Bearer key for `judge_url` (never printed or logged)."""

    judge_model: str = Field("default", min_length=1, max_length=256)
    """Model name sent to `judge_url`."""

    prm_m: int | None = Field(None, ge=1, le=15)
    """Judge votes per turn; the majority of {+1, -1, 0} wins, ties give 0. Unset: 3 for `rl` and
    `combine`, 1 for `opd`."""

    judge_temperature: float = Field(0.6, ge=0, le=2)
    """Sampling temperature of the judge's votes (above 0 so that m votes are m opinions)."""

    judge_max_tokens: int = Field(96, ge=8, le=4096)
    """Most tokens a judge vote or hint may take."""

    hint_min_chars: int = Field(20, ge=1, le=2000)
    """Shorter hints are rejected (the sample then leaves OPD, reason `hint_too_short`)."""

    concurrency: int = Field(4, ge=1, le=256)
    """Turns judged at once (their votes batch in the engine beside serving traffic)."""

    poll_s: float = Field(0.5, gt=0, le=60)
    """How often the reward worker looks for turns whose next state has arrived."""

    max_judge_attempts: int = Field(3, ge=1, le=100)
    """Judging attempts per turn before the worker gives up on it. Each failed attempt (a judge
    server error, a crash in a rule) is recorded on the turn's sample with its error; the give-up
    too, with the last error as its reason (`clawr1 pool show STEP`, the dashboard's session page),
    and the turn is not judged again. Explicit feedback or a session outcome can still reward it."""

    judge_retry_s: float = Field(30.0, gt=0, le=3600)
    """Wait before a turn whose judging failed is tried again, doubled after each failure (30 s,
    60 s, ...): a judge outage shorter than the waits together gives up on no turn."""

    step_weight: float = Field(0.0, ge=0.0, le=1.0)
    """Step-wise rewards for long tasks: when a session closes with an outcome, each earlier main
    turn the judge scored trains with (1 - w) * judge + w * outcome (explicit feedback still
    wins; the last turn gets the outcome). 0 = only the last turn gets the outcome. The close
    route's `step_weight` overrides it per session."""


class GuardConfig(_Section):
    enabled: bool = True
    """Every new LoRA version is a candidate: the gateway asks it the probe requests (held out from
    recent traffic, as side turns), measures the replies' quality and drift against the base model's
    and the incumbent's on the same requests and seeds, and serves it only when it is not worse
    beyond the bounds below; a rejected version is never served and the trainer rolls back to the
    incumbent. Off: every published version is served at once, promoted as published (the
    admin's `clawr1 rollback` and `clawr1 pin` work the same)."""

    probes: int = Field(12, ge=8, le=256)
    """Held-out requests a candidate answers (at least 8: the base's normal range needs them)."""

    everyday_probes: int = Field(4, ge=0, le=16)
    """Of the `probes`, how many are built-in everyday requests (in the context of the traffic's
    system prompt) rather than held-out traffic: a version that learned the users' questions may
    still have broken on others (refusals, another language, answers that no longer fit), which
    probes drawn from the same traffic do not ask."""

    probe_max_tokens: int = Field(64, ge=8, le=4096)
    """Reply length cap of a probe (the traffic's own cap when that is smaller)."""

    fallback_after_s: float = Field(60.0, ge=0, le=86_400)
    """When a candidate has waited this long and too little traffic was held out for a probe set,
    the set is filled up with built-in everyday requests (in the context of the traffic's system
    prompt), so a quiet deployment still learns; the verdict says how many probes were traffic."""

    refresh_versions: int = Field(8, ge=1, le=10_000)
    """A new probe set (and base calibration) is drawn from recent traffic every this many versions."""

    sane_bound: float = Field(0.1, ge=0, le=1)
    """Reject when the candidate's share of sane probe replies is lower than the incumbent's by more
    than this (paired: same requests, same seeds)."""

    base_bound: float = Field(0.1, ge=0, le=1)
    """Reject when it is lower than the base model's own share by more than this."""

    max_kl: float = Field(1.0, gt=0, le=100)
    """Reject when the mean per-token KL of the candidate's probe replies from the base model is
    above this (nats per token)."""

    @model_validator(mode="after")
    def _room_for_traffic(self) -> GuardConfig:
        if self.probes - self.everyday_probes < 4:
            raise ValueError("guard.everyday_probes leaves fewer than 4 of guard.probes for held-out traffic")
        return self

    decision_timeout_s: float = Field(300.0, gt=0, le=86_400)
    """How long the trainer waits for the verdict on a version it published before training on
    (with no gateway running, nothing decides)."""
