"""The GenerationStream both engines hand out: fed through an asyncio queue by whoever samples (the
local scheduler thread, a remote server's reader task) with TokenEvents, then the Generation, or
an exception; `generation` is set once it has ended. Subclasses say how to `cancel`."""

from __future__ import annotations

import asyncio

from clawr1.core.types import Generation, TokenEvent


class QueuedStream:
    def __init__(self, out: asyncio.Queue, gen: Generation):
        """`gen`: the request's Generation as it is being built (its sampler settles `version`)."""
        self.out, self.gen = out, gen
        self.generation: Generation | None = None
        self._failed = False

    @property
    def version(self) -> int:
        """The policy version that samples this request: the local engine settles it when it
        admits the request (a base-model request queued across a weights swap gets the new one)."""
        return self.gen.version

    def __aiter__(self) -> QueuedStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self.generation is not None or self._failed:
            raise StopAsyncIteration
        item = await self.out.get()
        if isinstance(item, BaseException):
            self._failed = True
            raise item
        if isinstance(item, Generation):
            self.generation = item
            raise StopAsyncIteration
        return item

    def ready(self) -> bool:
        """Whether `__anext__` returns (or ends) without waiting: the tokens a burst left on the
        queue go out in one write, with no keep-alive timer each (see `GenerationStream`)."""
        return self.generation is not None or self._failed or not self.out.empty()

    async def final(self) -> Generation:
        async for _ in self:
            pass
        if self.generation is None:
            raise RuntimeError("the stream failed before its generation ended")
        return self.generation

    def cancel(self) -> None:
        raise NotImplementedError
