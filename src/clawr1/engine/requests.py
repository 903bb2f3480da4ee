"""What the local engine's scheduler keeps of a request: the request itself (its sampling state and
the asyncio queue its stream reads), its prefill in progress, a prompt being re-prefilled after
new weights, and the stream handed to the caller. The scheduler (`engine/local.py`) owns them;
only its thread changes them, except `cancelled`, which the caller's `cancel()` sets."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from clawr1.core.types import Generation, SamplingParams
from clawr1.engine.queued import QueuedStream
from clawr1.engine.text import Advance


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    key: str  # peft adapter name, or `local.BASE` (no adapter)
    gen: Generation
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    generator: torch.Generator
    advance: Advance  # the token-advance rule: text, stops, length, what may stream
    cancelled: bool = False
    last_token: int = -1

    def send(self, item: Any) -> None:
        if self.loop.is_closed():  # its caller is gone: stop generating rather than kill the thread
            self.cancelled = True
            return
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


@dataclass(eq=False)
class Prefill:
    """A request being admitted: its cache so far and how many prompt tokens it holds."""

    request: Request
    cache: DynamicCache | None  # None until its first chunk looks up the prefix cache
    done: int = 0


@dataclass(eq=False)
class Rewarm:
    """A prompt the replaced weights had cached, being prefilled again under `key`'s new ones."""

    key: str
    ids: list[int]
    cache: DynamicCache | None = None  # None until its first chunk looks up the prefix cache
    done: int = 0


class LocalStream(QueuedStream):
    """Async iterator over a request's TokenEvents (the scheduler thread feeds it); `final()`
    returns the Generation."""

    def __init__(self, request: Request):
        super().__init__(request.out, request.gen)
        self._request = request

    def cancel(self) -> None:
        """Stop generating; the Generation finishes with `finish_reason="aborted"`."""
        self._request.cancelled = True
