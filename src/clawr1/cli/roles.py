"""The long-running commands: `clawr1 train` (one trainer, or N data-parallel ranks) and `clawr1 up`
(the gateway and judge here, the trainer as a child process, and the inference server when `up`
starts it; or every role as Ray actors). Status lines go through `say`: rich markup on a
terminal, JSON log records under `log_format = "json"`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from rich.console import Console

from clawr1.core.config import Config, to_toml

err_console = Console(stderr=True)


def say(config: Config, markup: str, message: str, **fields: object) -> None:
    """A status line of a long-running command: rich markup on a terminal; under `log_format =
    "json"` a log record with its fields instead, so every line a log shipper reads is JSON."""
    if config.log_format == "json":
        logging.getLogger("clawr1.cli").info(message, extra=fields)
    else:
        err_console.print(markup)


def cmd_train(args: argparse.Namespace, config: Config) -> int:
    import threading

    from clawr1.datapool import open_pool
    from clawr1.trainer.checkpoint import exists as checkpoint_exists
    from clawr1.trainer.loop import Trainer
    from clawr1.trainer.ranks import Ranks
    from clawr1.trainer.tenants import TenantTrainers

    if args.resume and not checkpoint_exists(config.data_dir):
        err_console.print(f"[red]error:[/red] --resume: no trainer checkpoint under {config.data_dir}")
        return 1
    if args.nproc > 1 and config.trainer.backend == "tinker":
        err_console.print("[red]error:[/red] --nproc > 1 is for local ranks; trainer.backend = \"tinker\" trains on "
                          "the service")
        return 2
    if args.nproc > 1 and config.tenants.adapter_per_tenant:
        err_console.print("[red]error:[/red] --nproc > 1 trains the shared adapter; per-tenant adapters train "
                          "in one process")
        return 2
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:  # the launcher: N copies of this command as ranks
        from clawr1.trainer.ranks import launch

        return launch([sys.executable, "-m", "clawr1.cli.main", *args.argv], args.nproc)
    ranks = Ranks.from_env(config.trainer.device)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # finish the current step, then exit
    with open_pool(config) as pool:
        with err_console.status("Loading the policy ..."):
            if config.trainer.backend == "tinker":
                from clawr1.trainer.tinker import TinkerTrainer

                trainer = TinkerTrainer(config, pool)
            else:
                trainer = (TenantTrainers(config, pool) if config.tenants.adapter_per_tenant
                           else Trainer(config, pool, ranks=ranks))
        where = (f"one adapter per tenant, resumed {trainer.versions()}" if isinstance(trainer, TenantTrainers)
                 else f"at step {trainer.step_count}, policy v{trainer.version}")
        if ranks.lead:
            say(config, f"[green]trainer[/green] method={config.trainer.method} batch={config.trainer.batch_size} "
                f"{where}{f', {ranks.world} ranks' if ranks.world > 1 else ''}; waiting for READY samples",
                "trainer waiting for READY samples", method=config.trainer.method,
                batch_size=config.trainer.batch_size, where=where, ranks=ranks.world)
        try:
            # Rank 0 decides when every rank stops (a rank leaving alone would hang the others).
            while not ranks.broadcast(stop.is_set()):
                metrics = trainer.run_once()
                if metrics is None:
                    if ranks.lead:
                        stop.wait(config.trainer.poll_s)
                    continue
                if not ranks.lead:
                    continue
                who = f"{metrics['tenant']} " if "tenant" in metrics else ""
                say(config, f"{who}v{metrics['version']}: {metrics['lease']} samples, loss {metrics['loss']:+.4f}, "
                    f"reward {metrics['reward_mean']:+.2f}, hints {metrics['hint_rate']:.0%}, "
                    f"clip {metrics['clip_frac']:.2f}, {metrics['total_s']:.1f} s",
                    f"published policy v{metrics['version']}", metrics=metrics)
        except KeyboardInterrupt:
            pass
        finally:
            trainer.close()  # flush TensorBoard, finish the W&B run
            ranks.close()
    return 0


def cmd_up(args: argparse.Namespace, config: Config) -> int:
    from clawr1.gateway.server import UnsafeBindError, check_exposure

    try:
        check_exposure(config)  # before anything starts
    except UnsafeBindError as exc:
        err_console.print(f"[red]error:[/red] {exc}")
        return 2
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it with the handler it found: the
    # default one would end this process before the `finally` below stops the trainer, orphaning it.
    signal.signal(signal.SIGTERM, _interrupt)
    if args.ray or args.ray_address:
        if config.trainer.backend == "tinker":
            err_console.print("[red]error:[/red] trainer.backend = \"tinker\" runs without Ray (the service is the "
                              "scale-out): drop --ray")
            return 2
        if args.trainer_procs > 1:  # under Ray, the ranks are actors
            config = config.model_copy(update={"ray": config.ray.model_copy(
                update={"trainer_ranks": args.trainer_procs})})
        return _up_ray(args, config)
    server = None
    if config.engine.backend in ("vllm", "sglang") and not config.engine.url:  # start the inference server ourselves
        from clawr1.engine.launcher import SERVED_NAME, InferenceServer
        from clawr1.engine.models import resolve_model

        log = Path(config.data_dir) / "run" / f"{config.engine.backend}.log"
        server = InferenceServer(config, resolve_model(config.engine.model, config.data_dir), log)
        with err_console.status(f"Starting the {config.engine.backend} server on {config.engine.model} (log: {log}) ..."):
            url = server.start()
        config = config.model_copy(update={"engine": config.engine.model_copy(
            update={"url": url, "served_model": SERVED_NAME})})
    try:
        return _up_local(args, config, server)
    finally:
        if server is not None:
            server.stop()


def _up_local(args: argparse.Namespace, config: Config, server: Any) -> int:
    """`up` without Ray: serve here, the trainer as a child process (and `server`, the inference
    server `up` started, watched: when it dies, `up` stops, saying why)."""
    import subprocess
    import tempfile

    from clawr1.gateway.server import UnsafeBindError, serve
    from clawr1.gateway.service import Gateway
    from clawr1.reward.worker import RewardWorker

    # The trainer is its own process (it never competes with serving for the GIL); it gets the
    # same resolved config, secrets included (the PostgreSQL pool's DSN), in a file only this user
    # can read (mkstemp's mode 0600), removed when `up` stops; nothing prints it.
    run_dir = Path(config.data_dir) / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".toml", dir=run_dir, delete=False) as f:
        f.write(to_toml(config, secrets=True))
    log_path = run_dir / "trainer.log"

    def ready(port: int, note: str) -> None:
        url = f"{config.gateway.scheme}://{config.gateway.host}:{port}/v1"
        board = f"{config.gateway.scheme}://{config.gateway.host}:{port}/dashboard"
        say(config, f"[green]Claw-R1[/green] serving on {url} (model {config.engine.model}); judge + trainer "
            f"({config.trainer.method}) running; dashboard {board}; trainer log {log_path}; {note}",
            f"serving on {url}; {note}", url=url, dashboard=board, model=config.engine.model,
            method=config.trainer.method, trainer_log=log_path)

    def jobs(gw: Gateway) -> list[Coroutine[Any, Any, None]]:
        worker = RewardWorker(gw.pool, gw.engine, config)
        gw.metrics.watch_judge(worker)  # its outcomes on /metrics
        return [worker.run(), supervise()] + ([watch_server()] if server is not None else [])

    server_died = False

    async def watch_server() -> None:
        """Serving cannot go on without the inference server: stop `up` (a service manager
        restarts the whole job; the pool and the trainer's checkpoint carry everything over)."""
        nonlocal server_died
        while server.alive():
            await asyncio.sleep(2.0)
        server_died = True
        logging.getLogger("clawr1.up").error("the %s server exited; stopping. %s", config.engine.backend, server.tail())
        signal.raise_signal(signal.SIGTERM)  # uvicorn's graceful shutdown, then the finally below

    with open(log_path, "ab") as trainer_log:
        command = [sys.executable, "-m", "clawr1.cli.main", "train", "--config", f.name,
                   "--nproc", str(args.trainer_procs)]
        trainer = subprocess.Popen(command, stdout=trainer_log, stderr=subprocess.STDOUT)

        async def supervise() -> None:
            """Serving never stops for the trainer: a trainer that dies is restarted (it resumes
            from its checkpoint; its lease comes back), and said so in the log."""
            nonlocal trainer
            while True:
                await asyncio.sleep(2.0)
                if trainer.poll() is not None:
                    logging.getLogger("clawr1.up").error("trainer exited with code %s (see %s); restarting it",
                                                         trainer.returncode, log_path)
                    await asyncio.sleep(3.0)
                    trainer = await asyncio.to_thread(subprocess.Popen, command, stdout=trainer_log,
                                                      stderr=subprocess.STDOUT)

        try:
            asyncio.run(serve(config, on_ready=ready, workers=jobs))
        except UnsafeBindError as exc:
            err_console.print(f"[red]error:[/red] {exc}")
            return 2
        except KeyboardInterrupt:
            pass
        finally:
            trainer.terminate()
            try:
                trainer.wait(timeout=30)
            except subprocess.TimeoutExpired:
                trainer.kill()  # crash-safe by design: the lease expires and comes back
            Path(f.name).unlink(missing_ok=True)
    return 1 if server_died else 0


def _up_ray(args: argparse.Namespace, config: Config) -> int:
    from clawr1.cluster.launch import up_ray

    def ready(port: int, note: str) -> None:
        url = f"{config.gateway.scheme}://{config.gateway.host}:{port}/v1"
        say(config, f"[green]Claw-R1 on Ray[/green] serving on {url} through {config.ray.replicas} engine replicas; "
            f"trainer and {config.ray.judge_workers} judge worker(s) as actors; dashboard "
            f"{config.gateway.scheme}://{config.gateway.host}:{port}/dashboard; {note}", f"serving on {url} (ray); {note}", url=url,
            replicas=config.ray.replicas, ray_address=args.ray_address or "local")

    try:
        up_ray(config, args.ray_address, ready)
    except KeyboardInterrupt:
        pass
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
