"""The roles as Ray actors. Each is a plain class (the launcher wraps it with `ray.remote` and its
resources); each rebuilds its state from disk when Ray restarts it, because an actor's memory is
lost with it: the engine reloads the adapters' served versions, the pool reopens its SQLite file
(or PostgreSQL database), the trainer resumes from its checkpoint.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from clawr1.core.config import Config
from clawr1.core.records import POLICY, Step
from clawr1.core.types import EngineError, SamplingParams

log = logging.getLogger(__name__)


class EngineReplica:
    """One whole engine (`load_engine`: local, or a client of a vLLM/SGLang server)."""

    def __init__(self, config: Config, index: int):
        from clawr1.engine import load_engine

        self.config, self.index = config, index
        self.engine = load_engine(config)
        self._restored = False

    async def ready(self) -> dict[str, int]:
        """Serve what is current: on the first call (after a start or a restart) load what serves
        each adapter (the first of `adapters.serve_order` that loads: pinned, else the newest
        promoted, else the base; never a rejected candidate) and the newest whole weights. Returns the adapters and their versions."""
        if not self._restored:
            from clawr1.engine import adapters

            if self.config.trainer.finetune == "full":
                newest = adapters.latest(Path(self.config.data_dir) / "weights", POLICY)
                if newest is not None:
                    await self.engine.load_weights(newest[1])
            root = Path(self.config.data_dir) / "adapters"
            names = sorted(d.name for d in root.iterdir() if d.name.startswith(POLICY)) if root.is_dir() else []
            for name in names:
                for version in adapters.serve_order(root, name):  # the next when one does not load
                    if not version:
                        break
                    try:
                        await self.engine.load_adapter(name, adapters.version_dir(root, name, version))
                        break
                    except EngineError as exc:
                        log.error("engine replica %d: %s v%d does not load: %s", self.index, name, version, exc)
            self._restored = True
        return {**self.engine.adapters(), "weights": self.engine.weights_version()}

    async def generate(self, prompt_ids: list[int], sampling: dict[str, Any], adapter: str | None
                       ) -> AsyncIterator[tuple]:
        """Streamed: ("version", v), then ("token", id, logprob, text) per token, then ("end", finish
        reason, matched stop, version): the version again, as the engine settled it when it admitted
        the request (a base-model request queued across a weights swap is sampled by the new
        weights). A cancelled call (the client went away) stops the engine's work."""
        stream = self.engine.generate(prompt_ids, SamplingParams(**sampling), adapter)
        try:
            yield ("version", stream.version)
            async for event in stream:
                yield ("token", event.token_id, event.logprob, event.text)
            gen = await stream.final()
            yield ("end", gen.finish_reason, gen.stop_match, gen.version)
        finally:
            stream.cancel()

    async def score(self, prompt_ids: list[int], completion_ids: list[int], adapter: str | None,
                    temperature: float, top_k: int, top_p: float) -> list[float]:
        return await self.engine.score(prompt_ids, completion_ids, adapter, temperature, top_k, top_p)

    async def load_adapter(self, name: str, path: str) -> int:
        return await self.engine.load_adapter(name, Path(path))

    async def unload_adapter(self, name: str) -> None:
        await self.engine.unload_adapter(name)

    async def load_weights(self, path: str) -> int:
        return await self.engine.load_weights(Path(path))

    async def adapters(self) -> dict[str, int]:
        return self.engine.adapters()


class PoolService:
    """The data pool as a service: every gateway, judge and trainer of the deployment writes and
    reads through it. Threaded (many concurrent calls share group commits); its state is the
    database, so a restarted service loses nothing that was acknowledged."""

    def __init__(self, config: Config):
        from clawr1.datapool import open_pool

        self.pool = open_pool(config)

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        return getattr(self.pool, method)(*args, **kwargs)

    def append_step(self, step: Step) -> bool:
        return self.pool.append_step(step)


class TrainerWorker:
    """The trainer (or one trainer per tenant) in a loop, on the pool service; with
    `ray.trainer_ranks` > 1, one data-parallel rank of it, which `join`s its group first."""

    def __init__(self, config: Config, pool_actor: Any, rank: int = 0, world: int = 1):
        from clawr1.trainer.ranks import Ranks

        self.config, self.pool_actor, self.rank, self.world = config, pool_actor, rank, world
        self.ranks = Ranks()
        self.stop_event = threading.Event()
        self.published: list[dict[str, Any]] = []
        self.trainer: Any = None
        if world == 1:
            self._build()

    def address(self) -> tuple[str, int]:
        """Rank 0: where the group meets (this node's address and a free port on it)."""
        import ray

        from clawr1.trainer.ranks import free_port

        return ray.util.get_node_ip_address(), free_port()

    def join(self, host: str, port: int) -> int:
        """Form the group with the other ranks (every rank's `join` runs at once), then load the
        policy. Each actor sees only the GPUs Ray gave it, so its rank's device is `cuda:0`."""
        from clawr1.trainer.ranks import Ranks, group_timeout

        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world), LOCAL_RANK="0", MASTER_ADDR=host,
                          MASTER_PORT=str(port))
        self.ranks = Ranks.from_env(self.config.trainer.device, group_timeout(self.config.guard.decision_timeout_s))
        self._build()
        return self.rank

    def _build(self) -> None:
        from clawr1.cluster.pool import RayPool
        from clawr1.trainer.loop import Trainer
        from clawr1.trainer.tenants import TenantTrainers

        pool = RayPool(self.pool_actor)
        self.trainer = (TenantTrainers(self.config, pool) if self.config.tenants.adapter_per_tenant
                        else Trainer(self.config, pool, ranks=self.ranks))

    def run(self) -> None:
        from clawr1.trainer.loop import train_until

        def published(metrics: dict[str, Any]) -> None:
            self.published.append({k: metrics[k] for k in ("version", "lease", "loss") if k in metrics})
            log.info("published v%s", metrics["version"])

        try:
            train_until(self.trainer, self.stop_event, self.ranks, 0.5, on_version=published)
        finally:
            self.trainer.close()
            self.ranks.close()

    def stop(self) -> None:
        self.stop_event.set()

    def versions(self) -> list[dict[str, Any]]:
        return self.published


class JudgeWorker:
    """A reward worker judging its share of the turns; LLM judges call the engine replicas."""

    def __init__(self, config: Config, pool_actor: Any, replicas: list[Any], shard: tuple[int, int]):
        from clawr1.cluster.pool import RayPool
        from clawr1.cluster.router import RouterEngine
        from clawr1.engine.models import resolve_model
        from clawr1.reward.worker import RewardWorker

        engine = RouterEngine(resolve_model(config.engine.model, config.data_dir), config.engine, replicas)
        self.worker = RewardWorker(RayPool(pool_actor), engine, config, shard=shard)

    async def run(self) -> None:
        await self.worker.run()

    async def counts(self) -> dict[str, Any]:
        return {"counts": dict(self.worker.counts),
                "outcomes": [[score, source, n] for (score, source), n in self.worker.outcomes.items()]}
