"""Where the Ray deployment's actors go: every role's actor created (or found again after a driver
restart) with the resources it asks for, and the trainer ranks joined into one group. The process
that runs them, `clawr1 up --ray`, is `clawr1.entrypoints.up_ray` (an entrypoint imports the Ray
deployment; the deployment never imports an entrypoint).
"""

from __future__ import annotations

import logging
from typing import Any

from clawr1.core.config import Config

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
