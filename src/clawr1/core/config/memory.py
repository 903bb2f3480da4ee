"""Per-user memory: corrections that take effect on the user's next turn (`clawr1/core/memory.py`)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from clawr1.core.config._base import TENANT_NAME, _Section


class MemoryConfig(_Section):
    enabled: bool = True
    """Keep a memory per user: a hint from a correction of a user's turn (the judge's, or explicit
    feedback) becomes an entry of that user, which the gateway adds to the system prompt of the
    user's later requests (and the step records, token for token). Off: no entry is made or added
    anywhere (stored entries stay, for when it is on again). A request turns it off for itself
    with `X-Memory: off`; `clawr1 memory off` turns it off for one user or tenant at run time."""

    off_tenants: list[str] = Field(default_factory=list, max_length=10_000)
    """Tenants whose requests neither get nor make memory entries (their corrections still train
    the weights)."""

    fallback: Literal["session", "tenant", "none"] = "session"
    """Who the user is when a request names none (`X-User-Id`, or the body's `user`: OpenAI's
    end-user id; Anthropic's `metadata.user_id`): `session`, the session the request names (URL
    path ids, `X-Session-Id`; a per-session key's session is always its user), so the memory lasts
    that session; `tenant`, the tenant's one user (a personal gateway: one person, one agent);
    `none`, nobody (no memory). A request whose session is matched from its history names no
    session: under `session` it has no memory (its corrections are in its own history)."""

    max_prompt_chars: int = Field(1500, ge=100, le=50_000)
    """Most characters of memory one prompt gets (header and entries): the newest entries that fit."""

    max_entries: int = Field(16, ge=1, le=256)
    """Most entries one prompt gets (the newest)."""

    refresh_s: float = Field(1.0, gt=0, le=3600)
    """How often the gateway reads the pool's changes to entries (new ones from the judge, which
    may run in another process; forgotten ones; the off switches): a correction reaches the next
    prompt within this after its hint is stored."""

    distill_weight: float = Field(1.0, ge=0, le=10)
    """Consolidation into the weights, the weight of its rows (0 = off; `trainer.method` `opd` or
    `combine`): each trained step whose prompt carried memory entries also trains as the same
    reply tokens after the prompt without them (the student), taught by the prompt as served (the
    teacher, `trainer.teacher`'s weights): OPD's advantage, teacher minus student logprob of each
    token. The step's own row keeps its recorded prompt, memory included, for RL."""

    retire_gap: float = Field(0.05, ge=0, le=5)
    """An entry retires (leaves the prompts, status `retired`) when the served version's gap between
    reminded and unreminded is at most this many nats a token: the weights say it without being
    reminded. With the guard on, measured on its held-out probes (the version's own unreminded
    replies, scored reminded and not: `guard/memory.py`); with it off, on the consolidation rows it
    trains on (the teacher's logprob with the entry minus the version's without it)."""

    return_gap: float = Field(0.15, ge=0, le=5)
    """A retired entry comes back (status `active`) when a later version's gap on the steps it was
    retired on grows past this: that version forgot. Above `retire_gap`, so that a gap near the
    edge does not flip an entry every version."""

    retire_min_tokens: int = Field(64, ge=1, le=1_000_000)
    """Reply tokens an entry's gap must be measured on (in one version) before it can retire."""

    recheck_entries: int = Field(8, ge=0, le=1000)
    """Retired entries the trainer measures again each version (the longest unchecked first), on
    the steps each was retired on: two forward passes (no gradient) per step."""

    @model_validator(mode="after")
    def _gaps(self) -> MemoryConfig:
        if self.return_gap < self.retire_gap:
            raise ValueError(f"memory.return_gap ({self.return_gap}) must be at least memory.retire_gap "
                             f"({self.retire_gap})")
        return self

    @field_validator("off_tenants")
    @classmethod
    def _tenants(cls, tenants: list[str]) -> list[str]:
        for tenant in tenants:
            if not re.fullmatch(TENANT_NAME, tenant):
                raise ValueError(f"memory.off_tenants: {tenant!r} must match {TENANT_NAME}")
        return tenants
