"""What both streaming routes share: the token loop with keep-alive ticks and a deadline, and SSE."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator

from clawr1.core.types import TokenEvent
from clawr1.engine.base import GenerationStream
from clawr1.gateway.errors import error_body


class TimedOut(Exception):
    """The request ran past `gateway.request_timeout_s`."""


async def events(stream: GenerationStream, keepalive_s: float, timeout_s: float) -> AsyncIterator[TokenEvent | None]:
    """The stream's tokens, with a `None` every `keepalive_s` without one (the request is queued
    or prefilling); raises TimedOut past the deadline."""
    deadline = time.monotonic() + timeout_s
    iterator = stream.__aiter__()
    while True:
        step = asyncio.ensure_future(iterator.__anext__())
        try:
            while not step.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimedOut
                done, _ = await asyncio.wait({step}, timeout=min(keepalive_s, left))
                if not done and time.monotonic() < deadline:
                    yield None
            event = step.result()
        except StopAsyncIteration:
            return
        finally:
            if not step.done():
                step.cancel()
        yield event


def sse(body: dict[str, Any]) -> str:
    return "data: " + json.dumps(body, separators=(",", ":")) + "\n\n"


def timeout_event(timeout_s: float) -> str:
    """OpenAI ends a failed stream with an error object as the last data event."""
    return sse(error_body(504, f"the engine did not finish within {timeout_s} s", code="timeout"))
