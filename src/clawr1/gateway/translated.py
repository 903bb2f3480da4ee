"""What the translated API surfaces share: Anthropic Messages (`anthropic.py`) and OpenAI Responses
(`responses.py`) are wire formats only. Each request is turned into OpenAI chat messages and tools
and then takes exactly chat's path: render, admit and generate, resolve the session from those
messages, the path and the X-Session-* headers, record the step token for token, teach the history
matcher the reply. So a session's steps look the same in the pool whichever API the agent speaks,
and a conversation continues across turns by history matching as it does for chat.

One generation per request (neither API has `n`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from clawr1.core.types import Generation, ParsedCompletion, SamplingParams
from clawr1.engine.base import GenerationStream
from clawr1.gateway import schema
from clawr1.gateway.app import Caller, Gateway
from clawr1.gateway.chat import safe_text
from clawr1.gateway.errors import APIError
from clawr1.gateway.sessions import Turn, affinity_key
from clawr1.gateway.streaming import events


@dataclass
class Call:
    """One admitted request: its session turn, the chat-shaped messages stored with its step, and
    the engine stream. Whoever begins a call must end it with `result` or, when streaming, `settle`
    in a `finally` (that releases the admission and records the step)."""

    gw: Gateway
    turn: Turn
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    stream: GenerationStream
    step_id: str
    started: float
    prompt_tokens: int  # for usage in the first streamed event, before the generation ends

    @classmethod
    def begin(cls, gw: Gateway, request: Request, caller: Caller, messages: list[dict[str, Any]],
              tools: list[dict[str, Any]] | None, sampling: SamplingParams, path_ids: tuple[str, str] | None,
              reply_id: str, started: float) -> Call:
        """Render and submit (a bad conversation raises here, before any session state moves)."""
        prompt_ids = gw.engine.render(messages, tools)
        headers = {k.lower(): v for k, v in request.headers.items()}
        [stream] = gw.start(prompt_ids, [sampling], caller.tenant,
                            affinity_key(caller.tenant, messages, headers, path_ids))
        turn = gw.sessions.resolve(caller.tenant, messages, headers, path_ids, caller.session_id)
        return cls(gw, turn, messages, tools, stream, f"{reply_id}-0", started, len(prompt_ids))

    async def result(self, request: Request) -> tuple[Generation, ParsedCompletion] | None:
        """Not streaming: wait for the whole generation and record it. None when the client went
        away (the step is stored as aborted); 504 past `gateway.request_timeout_s`."""
        gw = self.gw
        try:
            gens, outcome = await gw.collect(request, [self.stream])
            gw.record(self.turn, self.messages, self.tools, gens[0], self.step_id, self.started)
        finally:
            gw.pending -= 1
        gw.turn_done(self.turn)
        if outcome == "disconnected":
            return None
        if outcome == "timeout":
            raise APIError(504, f"the engine did not finish within {gw.config.gateway.request_timeout_s} s",
                           code="timeout")
        return self.reply(gens[0])

    def reply(self, gen: Generation) -> tuple[Generation, ParsedCompletion]:
        """Parse the finished generation and let the session's next request match it."""
        parsed = self.gw.engine.parse(gen.content)
        self.gw.sessions.record(self.turn, self.messages, schema.message_of(parsed))
        return gen, parsed

    async def deltas(self) -> AsyncIterator[str | None]:
        """Streaming: content that is safe to show as it is sampled (tool-call markup is held back,
        as chat does), None for a keep-alive tick; raises `TimedOut` past the deadline. After the
        last delta, `finished()` gives the result."""
        sent = visible = ""
        config = self.gw.config.gateway
        async for event in events(self.stream, config.keepalive_s, config.request_timeout_s):
            if event is None:
                yield None
                continue
            visible += event.text
            delta = safe_text(visible, sent, self.tools is not None)
            if delta:
                sent += delta
                yield delta

    async def finished(self) -> tuple[Generation, ParsedCompletion]:
        """Streaming, after the last delta: the whole generation, parsed (see `reply`)."""
        return self.reply(await self.stream.final())

    def settle(self) -> None:
        """A stream's `finally` (normal end, disconnect, timeout, error): stop the engine and record
        what was sampled, in a task of its own so a cancelled response cannot cancel the write."""
        self.stream.cancel()
        self.gw.spawn(self.gw.settle_stream(self.turn, self.messages, self.tools, self.stream, self.step_id,
                                            self.started))


def tail(gen: Generation, parsed: ParsedCompletion, sent: str) -> str:
    """Content not streamed yet when the generation ended (a held-back tool-call prefix that turned
    out to be text, or text before a stop sequence); none when the reply became tool calls."""
    if parsed.tool_calls or len(gen.content) <= len(sent):
        return ""
    return gen.content[len(sent):]


def text_content(texts: list[str]) -> str | list[dict[str, str]] | None:
    """Chat `content` for a message's text blocks: a string for one block, OpenAI text parts for
    several (rendered joined, as chat renders parts), None for none."""
    if not texts:
        return None
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": t} for t in texts]


def now() -> tuple[float, int]:
    """(perf counter for step timings, unix seconds for `created` fields)."""
    return time.perf_counter(), int(time.time())
