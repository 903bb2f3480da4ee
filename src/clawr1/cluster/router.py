"""`RouterEngine`: the Engine contract over N engine replicas (Ray actors), for the gateway.

- Routing: rendezvous hashing of the request's affinity key (its session) over the live replicas,
  so a session's turns land where its prefix is cached and only the sessions of a replica that
  goes away move; requests without a key go round-robin.
- Failure: a replica that dies is marked down and skipped; a request it held that had not streamed
  a token yet is sent to the next replica (nothing was sampled, so nothing is lost); one that had
  fails like any engine failure (a 502 whose step is stored `aborted`, never a silent mix of two
  replicas' tokens). A watcher asks downed replicas `ready()` until Ray's restart answers; a
  restarted replica has reloaded what serves each adapter (`adapters.serve_order`) itself.
- Versions: `load_adapter` loads a version on every live replica, then flips the router's view.
  Rendering, parsing and the context check happen here with the model's own tokenizer, so the
  ids a replica samples from are the ids recorded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
from pathlib import Path
from typing import Any

from clawr1.core.config import EngineConfig
from clawr1.core.types import (
    EngineFailure,
    Generation,
    SamplingParams,
    TokenEvent,
    UnknownAdapterError,
)
from clawr1.engine.frontend import Frontend
from clawr1.engine.remote import RemoteEngine

log = logging.getLogger(__name__)


def _dead(error: BaseException) -> bool:
    import ray.exceptions

    return isinstance(error, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


class RouterStream:
    """A GenerationStream over a replica's streamed `generate`, retried elsewhere until the first token."""

    def __init__(self, router: RouterEngine, prompt_ids: list[int], sampling: SamplingParams, adapter: str | None,
                 order: list[int]):
        self.router, self.sampling, self.adapter, self.order = router, sampling, adapter, order
        self.version = router._versions.get(adapter, 0) if adapter else router._weights_version
        self.gen = Generation(prompt_ids=list(prompt_ids), adapter=adapter, version=self.version, **sampling.recorded)
        self.replica: int | None = None
        self._refs: Any = None
        self._done = False
        self._submit()

    def _submit(self) -> None:
        self.replica = self.order.pop(0)
        fields = {"max_tokens": self.sampling.max_tokens, "temperature": self.sampling.temperature,
                  "top_p": self.sampling.top_p, "top_k": self.sampling.top_k, "stop": self.sampling.stop,
                  "seed": self.sampling.seed}
        actor = self.router.replicas[self.replica]
        self._refs = actor.generate.options(num_returns="streaming").remote(self.gen.prompt_ids, fields, self.adapter)

    def __aiter__(self) -> RouterStream:
        return self

    async def __anext__(self) -> TokenEvent:
        while not self._done:
            try:
                item = await (await self._refs.__anext__())
            except StopAsyncIteration:
                break
            except Exception as error:
                if not _dead(error):
                    self._done = True
                    raise EngineFailure(f"engine replica {self.replica} failed: {error}") from error
                self.router.mark_down(self.replica, error)
                self.order = [i for i in self.order if self.router.up[i]]
                if self.gen.token_ids or not self.order:  # tokens already out: never splice two replicas
                    self._done = True
                    self.gen.finish_reason = "aborted"
                    raise EngineFailure(f"engine replica {self.replica} died during the request") from error
                self._submit()  # nothing sampled yet: the next replica takes it
                continue
            if item[0] == "version":
                self.gen.version = self.version = item[1]
            elif item[0] == "token":
                _, token, logprob, text = item
                self.gen.token_ids.append(token)
                self.gen.logprobs.append(logprob)
                return TokenEvent(token, logprob, text)
            else:
                self.gen.finish_reason, self.gen.stop_match = item[1], item[2]
                self.gen.version = self.version = item[3]  # what sampled it (see `EngineActor.generate`)
        self._done = True
        self.gen.text = self.router.tokenizer.decode(self.gen.token_ids, skip_special_tokens=True)
        self.gen.finish_reason = self.gen.finish_reason or "aborted"
        raise StopAsyncIteration

    async def final(self) -> Generation:
        async for _ in self:
            pass
        return self.gen

    def cancel(self) -> None:
        """The client went away: the replica's call is cancelled, which stops its engine's work."""
        import ray

        if self._refs is not None and not self._done:
            ray.cancel(self._refs)


class RouterEngine(Frontend):
    def __init__(self, model_path: Path, config: EngineConfig, replicas: list[Any]):
        super().__init__(model_path, config.max_context)
        self.config, self.replicas = config, replicas
        # The guard reads this to sample its probes at temperature 1 where the engine scores only there
        # (`Guard._draw`). The replicas are `load_engine` of this same engine config (`EngineReplica`):
        # every backend but `local` is a `RemoteEngine` (vLLM, SGLang, Tinker), whose servers score the
        # unscaled distribution only. Without it a Ray deployment on vLLM sampled probes at 0.7, which
        # its replicas then refuse to score at (no verdict).
        self.scores_at_temperature_one_only = (config.backend != "local"
                                               and RemoteEngine.scores_at_temperature_one_only)
        self.up = [True] * len(replicas)
        self._versions: dict[str, int] = {}
        self._paths: dict[str, Path] = {}  # the directory each served version was loaded from
        self._weights_version, self._weights_path = 0, None  # full fine-tuning's served weights
        self._turn = itertools.count()
        self._watcher: asyncio.Task | None = None

    # ---- routing --------------------------------------------------------------------------
    def order(self, affinity: str | None) -> list[int]:
        """Live replicas, best first: by rendezvous hash of the key, else round-robin."""
        live = [i for i, alive in enumerate(self.up) if alive]
        if not live:
            raise EngineFailure("no engine replica is up; Ray is restarting them")
        if affinity is None:
            start = next(self._turn) % len(live)
            return live[start:] + live[:start]
        return sorted(live, key=lambda i: hashlib.blake2b(f"{affinity}/{i}".encode(), digest_size=8).digest(),
                      reverse=True)

    def mark_down(self, index: int, error: BaseException) -> None:
        if self.up[index]:
            self.up[index] = False
            log.error("engine replica %d is down (%s); routing around it until it is back", index,
                      type(error).__name__)
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        """Ask downed replicas until Ray's restart answers (it reloads the current adapters)."""
        while not all(self.up):
            await asyncio.sleep(0.5)
            for index in [i for i, alive in enumerate(self.up) if not alive]:
                try:
                    served = await asyncio.wait_for(self.replicas[index].ready.remote(), timeout=10)
                except Exception as error:  # noqa: BLE001 - still restarting (or unreachable): ask again next round
                    log.debug("engine replica %d is not back yet: %r", index, error)
                    continue
                missing = [n for n, v in self._versions.items() if served.get(n) != v]
                try:  # restarted between a publish and our broadcast: it takes ours before it serves
                    for name in missing:
                        await self.replicas[index].load_adapter.remote(name, str(self._paths[name]))
                    if self._weights_path is not None and served.get("weights") != self._weights_version:
                        await self.replicas[index].load_weights.remote(str(self._weights_path))
                except Exception as error:  # noqa: BLE001 - it stays down (never serves stale weights); tried again next round
                    log.warning("engine replica %d is back but could not load the current versions (%r); "
                                "keeping it out of rotation and trying again", index, error)
                    continue
                self.up[index] = True
                log.warning("engine replica %d is back, serving %s", index, served)

    # ---- the contract (render and parse: `Frontend`) ---------------------------------------
    def generate(self, prompt_ids: list[int], sampling: SamplingParams, adapter: str | None = None,
                 affinity: str | None = None) -> RouterStream:
        room = self.room(prompt_ids)
        if adapter is not None and adapter not in self._versions:
            raise UnknownAdapterError(f"no adapter named {adapter!r}", "model")
        clamped = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, room))  # every other setting kept
        return RouterStream(self, prompt_ids, clamped, adapter, self.order(affinity))

    async def score(self, prompt_ids: list[int], completion_ids: list[int], adapter: str | None = None,
                    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> list[float]:
        for index in self.order(None):
            try:
                return await self.replicas[index].score.remote(prompt_ids, completion_ids, adapter, temperature,
                                                               top_k, top_p)
            except Exception as error:
                if not _dead(error):
                    raise
                self.mark_down(index, error)
        raise EngineFailure("no engine replica is up; Ray is restarting them")

    async def load_adapter(self, name: str, path: Path) -> int:
        """Load on every live replica (each swaps atomically), then serve it from here on."""
        live = [i for i, alive in enumerate(self.up) if alive]
        results = await asyncio.gather(*(self.replicas[i].load_adapter.remote(name, str(path)) for i in live),
                                       return_exceptions=True)
        version = None
        for index, result in zip(live, results, strict=True):
            if isinstance(result, BaseException):
                if not _dead(result):
                    raise result
                self.mark_down(index, result)
            else:
                version = result
        if version is None:
            raise EngineFailure(f"no engine replica loaded {name} from {path}")
        self._versions[name], self._paths[name] = version, Path(path)
        return version

    async def unload_adapter(self, name: str) -> None:
        if self._versions.pop(name, None) is None:
            raise UnknownAdapterError(f"no adapter named {name!r}", "model")
        live = [i for i, alive in enumerate(self.up) if alive]
        await asyncio.gather(*(self.replicas[i].unload_adapter.remote(name) for i in live), return_exceptions=True)

    def adapters(self) -> dict[str, int]:
        return dict(self._versions)

    async def load_weights(self, path: Path) -> int:
        """Full weights on every live replica (each drains its batch and swaps), then serve them."""
        live = [i for i, alive in enumerate(self.up) if alive]
        results = await asyncio.gather(*(self.replicas[i].load_weights.remote(str(path)) for i in live),
                                       return_exceptions=True)
        loaded = [r for r in results if not isinstance(r, BaseException)]
        for index, result in zip(live, results, strict=True):
            if isinstance(result, BaseException):
                if not _dead(result):
                    raise result
                self.mark_down(index, result)
        if not loaded:
            raise EngineFailure(f"no engine replica loaded the weights at {path}")
        self._weights_version, self._weights_path = loaded[0], Path(path)
        return loaded[0]

    def weights_version(self) -> int:
        return self._weights_version

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
