"""`clawr1 up --ray` / `clawr1 up --ray-address ADDR`: the main job with its roles as Ray actors
(the Ray counterpart of `clawr1.entrypoints.up`; the one supervisor restarts their loops).

The gateway runs in this process (it is the HTTP front door and binds like `clawr1 up`); engine
replicas, the pool service, the trainer and the judge workers are actors named in
`ray.namespace` (placed by `clawr1.cluster.launch`), restarted by Ray when they die (each resumes
from disk). The data dir must be on storage every node sees (adapters, checkpoints, and the SQLite
pool unless `pool.backend = "postgres"`); model directories too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from clawr1.cluster.launch import start_actors, trainer_group
from clawr1.core.config import Config
from clawr1.entrypoints.supervise import keep_running

if TYPE_CHECKING:
    from clawr1.gateway.service import Gateway


async def keep_group_running(config: Config, pool: Any, group: list[list[Any]]) -> None:
    """The trainer ranks' loops: when one rank fails (its actor died, or the group broke), every
    rank is stopped and a new group formed; it resumes from the checkpoint, and the lease of the
    version in the making comes back. `group[0]` is the running group (for the shutdown)."""
    import ray

    generations = itertools.count()

    async def run_group() -> None:
        ranks = await asyncio.to_thread(trainer_group, config, pool, next(generations))
        group[:] = [ranks]
        try:
            await asyncio.gather(*[rank.run.remote() for rank in ranks])
        except Exception:
            for rank in ranks:
                ray.kill(rank, no_restart=True)
            raise

    await keep_running("the trainer ranks", run_group)


def up_ray(config: Config, address: str | None, on_ready: Callable[[int, str], None]) -> None:
    import ray

    from clawr1.cluster.pool import RayPool
    from clawr1.cluster.router import RouterEngine
    from clawr1.engine.models import resolve_model
    from clawr1.entrypoints.serve import serve

    # Without an address Ray starts a local instance for this job ("local": never a cluster some
    # earlier `ray start` left in /tmp/ray), its dashboard off (one less port).
    ray.init(address=address or "local", namespace=config.ray.namespace, logging_level=logging.WARNING,
             **({} if address else {"include_dashboard": False}))
    try:
        roles = start_actors(config)
        router = RouterEngine(resolve_model(config.engine.model, config.data_dir), config.engine, roles["replicas"])

        def workers(gw: Gateway) -> list[Coroutine[Any, Any, None]]:
            jobs = ([keep_running("trainer", lambda: roles["trainer"].run.remote())] if roles["trainer"] is not None
                    else [keep_group_running(config, roles["pool"], group)])
            jobs += [keep_running(f"judge {i}", lambda j=judge: j.run.remote()) for i, judge in enumerate(roles["judges"])]
            return jobs

        group: list[list[Any]] = []  # the trainer ranks' current group, when there are several
        try:
            asyncio.run(serve(config, on_ready=on_ready, workers=workers, engine=router, pool=RayPool(roles["pool"])))
        finally:
            trainers = [roles["trainer"]] if roles["trainer"] is not None else (group[0] if group else [])
            ray.get([t.stop.remote() for t in trainers], timeout=60)
    finally:
        ray.shutdown()
