"""What both streaming routes share: the token loop with keep-alive ticks and a deadline, and SSE."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from clawr1.core.types import TokenEvent
from clawr1.engine.base import GenerationStream
from clawr1.gateway.errors import error_body


class TimedOut(Exception):
    """The request ran past `gateway.request_timeout_s`."""


async def events(stream: GenerationStream, keepalive_s: float, timeout_s: float) -> AsyncIterator[TokenEvent | None]:
    """The stream's tokens, with a `None` every `keepalive_s` without one (the request is queued
    or prefilling); raises TimedOut past the deadline. One timer per wait, no task per token:
    the stream's `__anext__` is a queue get, which a timeout cancels safely."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    iterator = stream.__aiter__()
    ready = getattr(stream, "ready", None)  # optional in the engine contract
    while True:
        left = deadline - loop.time()
        if left <= 0:
            raise TimedOut
        try:
            if ready is not None and ready():
                # No wait ahead: no timeout context at all (even `timeout(None)` is an object, an
                # enter and an exit a token: 7% of a streamed reply's time under cProfile).
                event = await iterator.__anext__()
            else:
                async with asyncio.timeout(min(keepalive_s, left)):
                    event = await iterator.__anext__()
        except TimeoutError:
            yield None
            continue
        except StopAsyncIteration:
            return
        yield event


MARK = "\x00clawr1 text\x00"
"""Stands in for a token's text in an event rendered once (`spliced`)."""


def spliced(render: Callable[[str], str]) -> Callable[[str], str]:
    """`render` (a token's text -> its event) for the event of nearly every token: rendered once
    with `MARK` in the text's place, then each text's JSON string put there (0.3 us a token against
    3-5 us for building and dumping the event). The text must be the event's last string, as the
    other ones (a client's model name) may hold the mark."""
    head, tail = render(MARK).rsplit(json.dumps(MARK), 1)
    string = json.encoder.encode_basestring_ascii  # what `json.dumps(text)` calls, without its checks
    return lambda text: head + string(text) + tail


# `json.dumps(body, separators=(",", ":"))`, its C encoder built once instead of on every call (no
# circular-reference check: a cycle is a RecursionError, not a ValueError).
_sse_encoder = json.encoder.c_make_encoder and json.encoder.c_make_encoder(
    None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True)


def sse(body: dict[str, Any]) -> str:
    data = "".join(_sse_encoder(body, 0)) if _sse_encoder else json.dumps(body, separators=(",", ":"))
    return "data: " + data + "\n\n"


def timeout_event(timeout_s: float) -> str:
    """OpenAI ends a failed stream with an error object as the last data event."""
    return sse(error_body(504, f"the engine did not finish within {timeout_s} s", code="timeout"))
