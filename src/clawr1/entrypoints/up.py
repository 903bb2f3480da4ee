"""`clawr1 up`: the main job. Here: the gateway and the judge in this process, the trainer as a
child process kept running by the supervisor, and the inference server when `up` starts it. With
`--ray`: every role as Ray actors (`clawr1.entrypoints.up_ray`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from clawr1.core.config import Config, to_toml
from clawr1.entrypoints.console import err_console, say


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
        if config.gateway.workers > 1:
            err_console.print("[red]error:[/red] gateway.workers > 1 runs each worker on the configured engine; "
                              "under Ray, scale the engine with ray.replicas instead")
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
            update={"url": url, "served_model": SERVED_NAME, "api_key": server.key})})
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

    from clawr1.entrypoints.serve import serve
    from clawr1.entrypoints.supervise import keep_running
    from clawr1.entrypoints.workers import ListenError
    from clawr1.gateway.server import UnsafeBindError
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
            """Serving never stops for the trainer: one that exits is started again (it resumes
            from its checkpoint; its lease comes back), and said so in the log."""
            async def watch() -> None:
                nonlocal trainer
                if trainer.poll() is not None:  # it exited: started again after the supervisor's pause
                    trainer = await asyncio.to_thread(subprocess.Popen, command, stdout=trainer_log,
                                                      stderr=subprocess.STDOUT)
                while trainer.poll() is None:
                    await asyncio.sleep(2.0)
                raise RuntimeError(f"exited with code {trainer.returncode} (see {log_path})")

            await keep_running("the trainer", watch, again_on_return=True, delay_s=3.0)

        try:
            asyncio.run(serve(config, on_ready=ready, workers=jobs))
        except (UnsafeBindError, ListenError) as exc:
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
    from clawr1.entrypoints.up_ray import up_ray

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
