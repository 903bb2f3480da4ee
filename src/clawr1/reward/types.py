"""The reward stage's value types and the two small protocols every judge implements."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Message = dict[str, Any]
Source = Literal["rule", "judge", "classifier"]
HintReason = Literal["no_correction", "too_short", "unparsable", "not_requested"]

Complete = Callable[[list[Message], float, int], Awaitable[str]]
"""`complete(messages, temperature, max_tokens) -> text`: one chat completion. A trailing assistant
message is an answer prefix: backends that can continue it (the embedded engine) do and return the
prefix plus the continuation; others drop it and the model answers from the instructions alone."""


@dataclass(frozen=True)
class Judgement:
    """A turn's reward and hint, with everything needed to see why (`clawr1 pool show`)."""

    score: int  # +1, -1 or 0 (0 = masked, not trained)
    votes: list[int]  # each vote: +1, -1 or 0 (unparsable votes count as 0)
    raw: list[str]  # the judge's raw outputs, one per vote
    evidence: str  # rule evidence text, or "judge majority 2/3 (+1)" etc.
    source: Source
    hint: str | None = None  # the accepted hint (longest of the hint votes), or None
    hint_reason: HintReason | None = None  # why there is no hint; None when there is one
    hint_raw: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.score not in (-1, 0, 1):
            raise ValueError(f"Judgement.score must be -1, 0 or +1, got {self.score!r}")
        if (self.hint is None) == (self.hint_reason is None):
            raise ValueError("a Judgement has either a hint or a reason for having none")


@dataclass(frozen=True)
class HintResult:
    """The outcome of hint extraction for one turn."""

    hint: str | None
    reason: HintReason | None
    raw: list[str] = field(default_factory=list)


NOT_REQUESTED = HintResult(None, "not_requested")


class Judge(Protocol):
    """Scores a turn from its next state. `context` is the turn's request messages (the task is the
    last user message in them), `reply` the assistant's reply text, `next_state` the messages that
    followed it (role user or tool)."""

    name: str

    async def judge(self, context: list[Message], reply: str, next_state: list[Message], m: int,
                    want_hint: bool) -> Judgement: ...


@runtime_checkable
class HintSource(Protocol):
    """A judge that can also extract a hint on its own (used when a rule already gave the score)."""

    async def hint(self, context: list[Message], reply: str, next_state: list[Message], m: int) -> HintResult: ...
