"""Serving through a Tinker-compatible service's sampling clients (`engine.backend = "tinker"`).

The prompt is rendered here with the model's own tokenizer and chat template (`engine.model`: a
local directory with the tokenizer of `tinker.base_model`), sent as token ids, and the sampler's
token ids and logprobs come back as they are: nothing is re-tokenised. The base model serves
requests without an adapter; each published version (`trainer.backend = "tinker"` writes its
sampler path into the version directory, `adapters.publish_remote`) gets its own sampling client,
and the swap is `RemoteEngine`'s: new requests get the new client from the flip on, running ones
finish on theirs. Creating the client is bounded by `tinker.timeout_s`; when it fails or times
out, the load raises `AdapterError` and the previous version keeps serving.

The service returns a whole sequence per call, so tokens stream out of the gateway as fast as the
sequence arrives, not one by one as it is sampled.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from clawr1.core.config import Config
from clawr1.core.tinker import service_client
from clawr1.core.types import AdapterError, Generation, SamplingParams
from clawr1.engine import adapters as store
from clawr1.engine.remote import RemoteEngine


class TinkerEngine(RemoteEngine):
    def __init__(self, model_path: Path, config: Config, service: Any = None):
        super().__init__(model_path, config.engine.model_copy(update={"url": config.engine.url or "http://tinker.invalid"}))
        self.timeout = config.tinker.timeout_s
        self.base_model = config.tinker.base_model
        self.service = service if service is not None else service_client()
        self.base: Any = None  # the base model's sampling client, made on first use (off the event loop)
        self.samplers: dict[str, Any] = {}  # served name (`policy@v7`) -> its sampling client

    def _resolve(self, value: Any) -> Any:
        return value.result(timeout=self.timeout) if hasattr(value, "result") else value

    async def _client(self, served: str | None) -> Any:
        if served is not None:
            return self.samplers[served]
        if self.base is None:
            self.base = await asyncio.wait_for(asyncio.to_thread(
                lambda: self._resolve(self.service.create_sampling_client(base_model=self.base_model))), self.timeout)
        return self.base

    async def _sample(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int,
                      served: str | None, gen: Generation) -> AsyncIterator[tuple[int, float]]:
        from tinker import types

        async def call() -> tuple[list[int], list[float]]:
            params = types.SamplingParams(max_tokens=max_tokens, temperature=sampling.temperature,
                                          top_p=sampling.top_p, top_k=sampling.top_k or -1, seed=sampling.seed,
                                          stop=list(sampling.stop) or None)
            client = await self._client(served)
            response = await _awaitable(client.sample(prompt=types.ModelInput.from_ints(list(prompt_ids)),
                                                      num_samples=1, sampling_params=params))
            sequence = response.sequences[0]
            if sequence.logprobs is None:
                raise ValueError("the sampler returned no logprobs (the trainer needs the sampled tokens' logprobs)")
            return list(sequence.tokens), list(sequence.logprobs)

        tokens, logprobs = await self._call(call(), "sampling")
        for token, logprob in zip(tokens, logprobs, strict=True):
            yield int(token), float(logprob)

    async def _score(self, ids: list[int], start: int, served: str | None) -> list[float]:
        from tinker import types

        async def call() -> list[float]:
            client = await self._client(served)
            out = await _awaitable(client.compute_logprobs(types.ModelInput.from_ints(ids),
                                                           prompt_logprobs_last_n=len(ids) - start))
            return [float(x) for x in out[start:]]

        return await self._call(call(), "scoring")

    async def _call(self, work: Any, what: str) -> Any:
        """`work` (a coroutine that talks to the service) within `tinker.timeout_s`. Any failure
        of the service (the SDK's own error types, a missing sequence, a timeout) becomes the
        ValueError that `RemoteEngine` turns into the request's EngineFailure (a 502 for the
        client): never a hung request."""
        try:
            return await asyncio.wait_for(work, self.timeout)
        except Exception as exc:
            raise ValueError(f"the service failed {what}: {type(exc).__name__}: {exc}") from exc

    async def _load(self, served: str, path: Path) -> None:
        remote = path / store.REMOTE
        if not remote.is_file():
            raise AdapterError(f"{path} is not a version trained on the service (no {store.REMOTE}); "
                               "engine.backend = \"tinker\" serves what trainer.backend = \"tinker\" publishes")
        sampler_path = json.loads(remote.read_text())["sampler_path"]
        try:
            client = await asyncio.wait_for(asyncio.to_thread(
                lambda: self._resolve(self.service.create_sampling_client(model_path=sampler_path))), self.timeout)
        except Exception as exc:  # the SDK's errors are its own types: any failure keeps the previous sampler
            raise AdapterError(f"the service did not give a sampler for {sampler_path}: {type(exc).__name__}: {exc}") \
                from exc
        self.samplers[served] = client

    async def _unload(self, served: str) -> None:
        self.samplers.pop(served, None)


async def _awaitable(value: Any) -> Any:
    """An SDK future (awaitable), or a plain value (a fake's)."""
    return await value if hasattr(value, "__await__") else value
