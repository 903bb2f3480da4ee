"""`clawr1 up --ray` / `clawr1 up --ray-address ADDR`: the main job with its roles as Ray actors
(the Ray counterpart of `clawr1.entrypoints.up`; the one supervisor restarts their loops).

The gateway runs in this process (it is the HTTP front door and binds like `clawr1 up`); engine
replicas, the pool service, the trainer and the judge workers are actors named in
`ray.namespace`, restarted by Ray when they die (each resumes from disk). The data dir must be on
storage every node sees (adapters, checkpoints, and the SQLite pool unless `pool.backend =
"postgres"`); model directories too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from clawr1.core.config import Config
from clawr1.entrypoints.supervise import keep_running

log = logging.getLogger(__name__)


def actor_name(config: Config, role: str, index: int | None = None) -> str:
    return f"clawr1-{role}" if index is None else f"clawr1-{role}-{index}"


def start_actors(config: Config) -> dict[str, Any]:
    """Create (or find, after a driver restart) every actor; wait until the replicas serve."""
    import ray

    from clawr1.cluster import actors

    def remote(cls: type, name: str, **options: Any) -> Any:
        return ray.remote(cls).options(name=name, get_if_exists=True, max_restarts=-1, **options)

    rc = config.ray
    pool = remote(actors.PoolService, actor_name(config, "pool"), max_concurrency=64,
                  max_task_retries=3).remote(config)
    replicas = [remote(actors.EngineReplica, actor_name(config, "engine", i), num_cpus=rc.replica_cpus,
                       num_gpus=rc.replica_gpus, max_task_retries=0).remote(config, i) for i in range(rc.replicas)]
    ray.get([r.ready.remote() for r in replicas])
    trainer = (remote(actors.TrainerWorker, actor_name(config, "trainer"), max_concurrency=2).remote(config, pool)
               if rc.trainer_ranks == 1 else None)  # ranks: `trainer_group`, started by `keep_group_running`
    judges = [remote(actors.JudgeWorker, actor_name(config, "judge", i)).remote(config, pool, replicas,
                                                                                 (i, rc.judge_workers))
              for i in range(rc.judge_workers)]
    return {"pool": pool, "replicas": replicas, "trainer": trainer, "judges": judges}


def trainer_group(config: Config, pool: Any, generation: int) -> list[Any]:
    """`ray.trainer_ranks` trainer rank actors, joined into one `torch.distributed` group."""
    import ray

    from clawr1.cluster import actors

    rc = config.ray
    ranks = [ray.remote(actors.TrainerWorker).options(
        name=f"{actor_name(config, 'trainer', i)}-g{generation}", max_concurrency=2, max_restarts=0,
        num_gpus=rc.trainer_gpus).remote(config, pool, i, rc.trainer_ranks) for i in range(rc.trainer_ranks)]
    host, port = ray.get(ranks[0].address.remote())
    ray.get([rank.join.remote(host, port) for rank in ranks])
    return ranks


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
    from clawr1.gateway.service import Gateway

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
