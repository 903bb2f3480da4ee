"""The Engine contract over an HTTP inference server (vLLM, SGLang): token ids in, sampled token ids
and their logprobs out. Rendering, parsing, stop sequences and the streamed text stay here, with
the served model's own tokenizer and chat template, so the prompt ids the server saw and the ids it
sampled are exactly what is recorded: nothing is ever re-tokenised from text.

A backend says how to sample (`_sample`: an async iterator of (token id, logprob)), score, and
load or unload a LoRA adapter on its server. Versions: each published version is loaded under its
own server-side name (`policy@v7`); the name clients use flips to it atomically, requests already
running finish on the one they started with, and a retired version is unloaded from the server
once nothing holds it. With several gateway processes on one server (`gateway.workers`), the leader
loads and unloads (keeping a retired version `retire_delay_s` longer, past any request another
process may still run on it) and the others `adopt` what it serves, never touching the server's set.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from clawr1.core.config import EngineConfig
from clawr1.core.types import (
    AdapterError,
    ContextLengthError,
    EngineFailure,
    EngineOverloadedError,
    Generation,
    InvalidRequestError,
    SamplingParams,
    UnknownAdapterError,
)
from clawr1.engine import adapters as store
from clawr1.engine.frontend import Frontend
from clawr1.engine.queued import QueuedStream
from clawr1.engine.text import Advance

log = logging.getLogger(__name__)


class RemoteStream(QueuedStream):
    """A GenerationStream fed by one server request running as a task."""

    def __init__(self, gen: Generation, sampling: SamplingParams, max_tokens: int):
        super().__init__(asyncio.Queue(), gen)
        self.sampling, self.max_tokens = sampling, max_tokens
        self.task: asyncio.Task | None = None

    def cancel(self) -> None:
        """Stop generating (the server request is closed); the Generation ends as `aborted`."""
        if self.task is not None:
            self.task.cancel()


class RemoteEngine(Frontend, ABC):
    """Serves through `config.url`; the tokenizer (and chat template) come from the local model
    directory of the same model."""

    scores_at_temperature_one_only = True  # `score`: the servers' prompt logprobs are unscaled (the guard reads it)

    def __init__(self, model_path: Path, config: EngineConfig):
        super().__init__(model_path, config.max_context)
        self.config = config
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.client = httpx.AsyncClient(base_url=str(config.url).rstrip("/"), headers=headers,
                                        timeout=httpx.Timeout(600.0, connect=10.0))
        self._adapters: dict[str, tuple[str, int]] = {}  # name -> (server-side name, version)
        self._holds: collections.Counter[str] = collections.Counter()  # server-side name -> requests on it
        self._retired: dict[str, float] = {}  # server-side name -> when it was retired (monotonic)
        self.retire_delay_s = 0.0
        """How long a retired version stays on the server before it is unloaded: 0 with one gateway
        process (its own holds say when); with several, long enough that no other process can still
        be running a request on it (set by the leader, `Gateway`)."""
        self._pending = 0
        self._closed = False
        self._tasks: set[asyncio.Task] = set()  # unloads of retired versions in progress
        self._delayed: set[asyncio.Task] = set()  # unloads waiting out `retire_delay_s` (cancelled on close)
        self._weights_version = 0

    # ---- what a backend provides ----------------------------------------------------------
    @abstractmethod
    def _sample(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int,
                served: str | None, gen: Generation) -> AsyncIterator[tuple[int, float]]:
        """The server's sampled (token id, logprob) pairs, as they come; stops at EOS or max_tokens.
        A server that reports which weights sampled it sets `gen.version`."""

    @abstractmethod
    async def _score(self, ids: list[int], start: int, served: str | None) -> list[float]:
        """Teacher-forced logprobs (temperature 1) of `ids[start:]`."""

    @abstractmethod
    async def _load(self, served: str, path: Path) -> None: ...

    @abstractmethod
    async def _unload(self, served: str) -> None: ...

    # ---- the contract (render and parse: `Frontend`) ---------------------------------------
    def generate(self, prompt_ids: list[int], sampling: SamplingParams, adapter: str | None = None,
                 affinity: str | None = None) -> RemoteStream:
        if self._closed:
            raise EngineFailure("the engine is closed")
        room = self.room(prompt_ids)
        if self._pending >= self.config.max_queue + self.config.max_batch:
            raise EngineOverloadedError(f"the engine has {self._pending} requests in flight; retry shortly")
        served, version = self._hold(adapter)
        version = version if adapter else self._weights_version
        stream = RemoteStream(Generation(prompt_ids=list(prompt_ids), adapter=adapter, version=version,
                                         **sampling.recorded), sampling,
                              min(sampling.max_tokens, room))
        self._pending += 1
        stream.task = asyncio.ensure_future(self._run(stream, served))
        return stream

    async def score(self, prompt_ids: list[int], completion_ids: list[int], adapter: str | None = None,
                    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> list[float]:
        if not completion_ids:
            raise InvalidRequestError("completion_ids must not be empty", "completion_ids")
        if len(prompt_ids) + len(completion_ids) > self.max_context:
            raise ContextLengthError(f"prompt + completion exceed the context of {self.max_context} tokens")
        if temperature != 1.0 or top_k > 0 or top_p < 1.0:  # the servers' prompt logprobs: unscaled, uncut
            raise InvalidRequestError("a remote engine scores at temperature 1, uncut (top_k 0, top_p 1), only",
                                      "temperature")
        served, _ = self._hold(adapter)
        try:
            return await self._score(list(prompt_ids) + list(completion_ids), len(prompt_ids), served)
        finally:
            self._release(served)

    async def load_adapter(self, name: str, path: Path) -> int:
        version = int(store.read_marker(Path(path))["version"])
        current = self._adapters.get(name)
        if current and current[1] == version:
            return version
        served = served_name(name, version)
        try:
            await self._load(served, Path(path).resolve())  # noqa: ASYNC240 - one path a version swap, not a request
        except httpx.HTTPError as exc:
            raise AdapterError(f"the server did not load {path}: {exc}") from exc
        self._adapters[name] = (served, version)  # the flip: new requests get it from here on
        if current:
            await self._retire(current[0])
        return version

    async def unload_adapter(self, name: str) -> None:
        current = self._adapters.pop(name, None)
        if current is None:
            raise UnknownAdapterError(f"no adapter named {name!r}", "model")
        await self._retire(current[0])

    def adopt(self, name: str, version: int) -> None:
        """Serve `name` as the version another process loaded on the server (`gateway.workers`):
        only where requests go changes here (0: the base); nothing is loaded or unloaded."""
        if version == 0:
            self._adapters.pop(name, None)
        else:
            self._adapters[name] = (served_name(name, version), version)

    def adopt_weights(self, version: int) -> None:
        """The whole-weights version another process loaded on the server."""
        self._weights_version = version

    def adapters(self) -> dict[str, int]:
        return {name: version for name, (_, version) in self._adapters.items()}

    async def load_weights(self, path: Path) -> int:
        raise AdapterError(f"{type(self).__name__} does not reload full weights from disk; train LoRA "
                           "(trainer.finetune = \"lora\") or serve with the local engine or SGLang")

    def weights_version(self) -> int:
        return self._weights_version

    async def close(self) -> None:
        self._closed = True
        for task in self._delayed:  # the server outlives this process; its versions are its business now
            task.cancel()
        await asyncio.gather(*self._tasks, *self._delayed, return_exceptions=True)
        await self.client.aclose()

    # ---- plumbing -------------------------------------------------------------------------
    def _hold(self, adapter: str | None) -> tuple[str | None, int]:
        if adapter is None:
            return None, 0
        if adapter not in self._adapters:
            raise UnknownAdapterError(f"no adapter named {adapter!r}", "model")
        served, version = self._adapters[adapter]
        self._holds[served] += 1
        return served, version

    def _release(self, served: str | None) -> None:
        if served is not None:
            self._holds[served] -= 1
            if self._retired and self._holds[served] <= 0:
                task = asyncio.ensure_future(self._collect())
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _retire(self, served: str) -> None:
        self._retired[served] = time.monotonic()
        if self.retire_delay_s > 0:
            task = asyncio.ensure_future(self._collect_after(self.retire_delay_s))
            self._delayed.add(task)
            task.add_done_callback(self._delayed.discard)
        else:
            await self._collect()

    async def _collect_after(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        await self._collect()

    async def _collect(self) -> None:
        """Unload retired versions nothing holds any more and retired at least `retire_delay_s`
        ago (an unload error is logged, not fatal)."""
        due = time.monotonic() - self.retire_delay_s
        for served in [s for s, when in self._retired.items() if self._holds[s] <= 0 and when <= due]:
            if self._retired.pop(served, None) is None:
                continue  # another collect (one runs per release) took it meanwhile
            self._holds.pop(served, None)
            try:
                await self._unload(served)
            except httpx.HTTPError as exc:
                log.warning("unloading %s from the server failed: %s", served, exc)

    async def _run(self, stream: RemoteStream, served: str | None) -> None:
        gen, advance = stream.gen, Advance(self.tokenizer, self.eos_ids, stream.sampling.stop, stream.max_tokens)
        try:
            async for token, logprob in self._sample(gen.prompt_ids, stream.sampling, stream.max_tokens, served, gen):
                events, reason = advance.events(gen, token, logprob)  # none while text is held back
                for event in events:
                    stream.out.put_nowait(event)
                if reason:
                    gen.finish_reason = reason
                    break
            if gen.finish_reason is None:  # the server ended it (an EOS it did not return, its own stop):
                # the text still held back is streamed on the last token's event, as a finish here would
                for event in advance.end(gen):
                    stream.out.put_nowait(event)
                gen.finish_reason = ("length" if len(gen.token_ids) >= stream.max_tokens and gen.stop_match is None
                                     else "stop")
            stream.out.put_nowait(gen)
        except asyncio.CancelledError:
            for event in advance.end(gen):  # the same: an abort streams what it held back
                stream.out.put_nowait(event)
            gen.finish_reason = "aborted"
            stream.out.put_nowait(gen)
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            gen.finish_reason = "aborted"
            stream.out.put_nowait(EngineFailure(f"the inference server failed: {type(exc).__name__}: {exc}"))
        finally:
            self._pending -= 1
            self._release(served)


def served_name(name: str, version: int) -> str:
    """A version's name on the server (`policy@v7`): every gateway process on it uses the same."""
    return f"{name}@v{version}"


async def sse_json(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a server-sent-event stream, until `[DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def raise_for_status(response: httpx.Response, what: str) -> None:
    if response.status_code >= 400:
        raise httpx.HTTPStatusError(f"{what}: HTTP {response.status_code}: {response.text[:500]}",
                                    request=response.request, response=response)
