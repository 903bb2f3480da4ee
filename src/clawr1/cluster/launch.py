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


def trainer_resources(config: Config, cluster_gpus: float) -> dict[str, Any]:
    """The Ray options of the trainer actor, or of each trainer rank actor: the GPUs it asks for
    (`ray.trainer_gpus`, see there; `cluster_gpus`: the cluster's GPUs, which decide `auto`), and
    with none, no GPU visible to it. Raises where the GPUs asked for cannot give each rank its own."""
    device, rc = config.trainer.device, config.ray
    gpus = rc.trainer_gpus
    if gpus is None:
        gpus = 1.0 if device.startswith("cuda") or (device == "auto" and cluster_gpus > 0) else 0.0
    if gpus == 0:
        if device.startswith("cuda"):
            raise ValueError(f"trainer.device = {device!r} with ray.trainer_gpus = 0: a trainer actor sees only "
                             "the GPUs Ray gives it; set ray.trainer_gpus (1: a GPU for each rank)")
        # Ray leaves every GPU visible to an actor that asked for none: it would take cuda:0 unasked.
        return {"num_gpus": 0, "runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}}
    if rc.trainer_ranks > 1 and gpus < 1:
        raise ValueError(f"ray.trainer_gpus = {gpus} with {rc.trainer_ranks} trainer ranks: two ranks could share "
                         "one GPU, which NCCL refuses; give each rank at least 1")
    free = cluster_gpus - rc.replicas * rc.replica_gpus
    if gpus * rc.trainer_ranks > free + 1e-9:  # a warning: an autoscaling cluster may still add the GPUs
        log.warning("the trainer asks Ray for %g GPU(s) but the cluster has %g beside the engine replicas' "
                    "(ray.replica_gpus); it waits until they exist (one GPU for both: give each a fraction)",
                    gpus * rc.trainer_ranks, max(free, 0))
    return {"num_gpus": gpus}


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
    trainer = (remote(actors.TrainerWorker, actor_name(config, "trainer"), max_concurrency=2,
                      **trainer_resources(config, ray.cluster_resources().get("GPU", 0))).remote(config, pool)
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
    resources = trainer_resources(config, ray.cluster_resources().get("GPU", 0))
    ranks = [ray.remote(actors.TrainerWorker).options(
        name=f"{actor_name(config, 'trainer', i)}-g{generation}", max_concurrency=2, max_restarts=0,
        **resources).remote(config, pool, i, rc.trainer_ranks) for i in range(rc.trainer_ranks)]
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
