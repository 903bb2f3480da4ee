"""The LLM judge (m votes + m hint votes, all concurrent) and the rules-first wrapper."""

from __future__ import annotations

import asyncio
from typing import Any

from clawr1.reward.parse import describe_majority, majority, parse_vote, select_hint
from clawr1.reward.prompts import hint_messages, judge_messages
from clawr1.reward.rules import rule_evidence
from clawr1.reward.types import NOT_REQUESTED, Complete, HintResult, HintSource, Judge, Judgement, Message


async def _aclose(thing: Any) -> None:
    close = getattr(thing, "aclose", None)
    if close is not None:
        await close()


class LLMJudge:
    """Asks a chat model m times whether the reply succeeded, and (with `want_hint`) m times for a
    hint. Votes run concurrently, so on the embedded engine they batch into one decode."""

    def __init__(self, complete: Complete, *, name: str = "llm", temperature: float = 0.6, vote_max_tokens: int = 8,
                 hint_max_tokens: int = 96, hint_min_chars: int = 20):
        self.complete = complete
        self.name = name
        self.temperature = temperature
        self.vote_max_tokens = vote_max_tokens
        self.hint_max_tokens = hint_max_tokens
        self.hint_min_chars = hint_min_chars

    async def _ask(self, messages: list[Message], m: int, max_tokens: int) -> list[str]:
        if m < 1:
            raise ValueError(f"m must be >= 1, got {m}")
        return list(await asyncio.gather(*(self.complete(messages, self.temperature, max_tokens) for _ in range(m))))

    async def hint(self, context: list[Message], reply: str, next_state: list[Message], m: int) -> HintResult:
        raw = await self._ask(hint_messages(context, reply, next_state), m, self.hint_max_tokens)
        return select_hint(raw, self.hint_min_chars)

    async def judge(self, context: list[Message], reply: str, next_state: list[Message], m: int,
                    want_hint: bool) -> Judgement:
        asks = [self._ask(judge_messages(context, reply, next_state), m, self.vote_max_tokens)]
        if want_hint:
            asks.append(self.hint(context, reply, next_state, m))
        results = await asyncio.gather(*asks)
        raw: list[str] = results[0]
        hint: HintResult = results[1] if want_hint else NOT_REQUESTED
        parsed = [parse_vote(text) for text in raw]
        votes = [0 if vote is None else vote for vote in parsed]
        score, _ = majority(votes)
        return Judgement(score=score, votes=votes, raw=raw, evidence=describe_majority(votes, parsed.count(None)),
                         source="judge", hint=hint.hint, hint_reason=hint.reason, hint_raw=hint.raw)

    async def aclose(self) -> None:
        await _aclose(self.complete)


class NoJudge:
    """Scores nothing (0, masked): what is left when only rules decide (`bench judge` coverage)."""

    name = "none"

    async def judge(self, context: list[Message], reply: str, next_state: list[Message], m: int,
                    want_hint: bool) -> Judgement:
        reason = "no_correction" if want_hint else "not_requested"
        return Judgement(score=0, votes=[], raw=[], evidence="no rule applies and no judge", source="judge",
                         hint_reason=reason)


class RuleFirstJudge:
    """Rule evidence first (no model call); the inner judge only where no rule applies. When a rule
    gives -1 and a hint is wanted, the inner judge still extracts it (an error message is a concrete
    correction), if it can."""

    def __init__(self, inner: Judge):
        self.inner = inner
        self.name = f"rules+{inner.name}"

    async def judge(self, context: list[Message], reply: str, next_state: list[Message], m: int,
                    want_hint: bool) -> Judgement:
        evidence = rule_evidence(next_state)
        if evidence is None:
            return await self.inner.judge(context, reply, next_state, m, want_hint)
        hint = NOT_REQUESTED
        if want_hint:
            hint = HintResult(None, "no_correction")
            if evidence.score < 0 and isinstance(self.inner, HintSource):
                hint = await self.inner.hint(context, reply, next_state, m)
        return Judgement(score=evidence.score, votes=[evidence.score], raw=[], evidence=evidence.text, source="rule",
                         hint=hint.hint, hint_reason=hint.reason, hint_raw=hint.raw)

    async def aclose(self) -> None:
        await _aclose(self.inner)
