"""An engine that always answers with a fixed text, for gateway tests of replies the tiny random
model never writes (tool calls) or of timing (one token every `delay` seconds). Rendering, parsing
and the tokenizer are the real engine's, so the prompt ids and the recorded completion ids are
exact; only the sampling is scripted."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from clawr1.core.types import Generation, SamplingParams, TokenEvent

LOGPROB = -0.25


class ScriptedStream:
    """Token i is due `(i + 1) * delay` after submission, whoever waits for it (as with the local
    engine, whose tokens arrive on a queue, a cancelled wait loses nothing); `cancel` stops it and
    `final` then returns what was sampled as `aborted`."""

    version = 0

    def __init__(self, prompt_ids: list[int], token_ids: list[int], pieces: list[str], delay: float):
        self.prompt_ids, self.token_ids, self.pieces, self.delay = prompt_ids, token_ids, pieces, delay
        self.sampled, self.cancelled, self.submitted = 0, False, time.monotonic()

    def __aiter__(self) -> ScriptedStream:  # its own iterator, as the local engine's stream is
        return self

    async def __anext__(self) -> TokenEvent:
        if self.cancelled or self.sampled == len(self.token_ids):
            raise StopAsyncIteration
        await asyncio.sleep(max(0.0, self.submitted + (self.sampled + 1) * self.delay - time.monotonic()))
        i, self.sampled = self.sampled, self.sampled + 1
        return TokenEvent(self.token_ids[i], LOGPROB, self.pieces[i])

    def ready(self) -> bool:
        """The next token is due (or the stream is over): `__anext__` will not wait for it."""
        over = self.cancelled or self.sampled == len(self.token_ids)
        return over or time.monotonic() >= self.submitted + (self.sampled + 1) * self.delay

    async def final(self) -> Generation:
        async for _ in self:
            pass
        ids = self.token_ids[:self.sampled]
        return Generation(prompt_ids=self.prompt_ids, token_ids=ids, logprobs=[LOGPROB] * len(ids),
                          text="".join(self.pieces[:self.sampled]), version=0, temperature=1.0,
                          finish_reason="stop" if self.sampled == len(self.token_ids) else "aborted")

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedEngine:
    def __init__(self, engine: Any, reply: str, delay: float = 0.0):
        self.engine, self.reply, self.delay = engine, reply, delay
        self.tokenizer, self.max_context = engine.tokenizer, engine.max_context
        self.sampling_defaults = engine.sampling_defaults

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.engine.render(messages, tools)

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> Any:
        return self.engine.parse(text, tools)

    def adapters(self) -> dict[str, int]:
        return {}

    def generate(self, prompt_ids: list[int], sampling: SamplingParams, adapter: str | None = None,
                 affinity: str | None = None) -> ScriptedStream:
        ids = self.tokenizer.encode(self.reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        texts = [self.tokenizer.decode(ids[:i], skip_special_tokens=True) for i in range(len(ids) + 1)]
        return ScriptedStream(prompt_ids, ids, [texts[i + 1][len(texts[i]):] for i in range(len(ids))], self.delay)
