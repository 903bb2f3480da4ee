"""`clawr1 serve`: the gateway alone (engine + pool + the FastAPI app), and `serve`, the coroutine
that `clawr1 up` and the Ray head run too, with their background jobs."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from clawr1.core.config import Config
from clawr1.entrypoints.console import err_console, say
from clawr1.entrypoints.workers import ListenError
from clawr1.gateway.server import UnsafeBindError, check_exposure

if TYPE_CHECKING:  # the serving stack is imported when it serves, not when the CLI starts
    from clawr1.datapool import DataPool
    from clawr1.engine import Engine
    from clawr1.gateway.service import Gateway

log = logging.getLogger(__name__)


async def serve(config: Config, on_ready: Callable[[int, str], None] | None = None,
                workers: Callable[[Gateway], list[Coroutine[Any, Any, None]]] | None = None,
                engine: Engine | None = None, pool: DataPool | None = None, engine_spec: str | None = None) -> None:
    """Serve until cancelled or interrupted. `workers(gateway)` gives background jobs that share
    the engine and pool (the reward worker under `clawr1 up`); they stop with the server. `engine`
    and `pool` default to the configured ones (a Ray deployment passes its router and pool service).
    With `gateway.workers` > 1 this process is worker 0 (`entrypoints/workers.py`); `engine_spec`
    (`module:attribute`) builds the engine of every worker, this one's included (a benchmark's fake)."""
    from clawr1.datapool import open_pool
    from clawr1.entrypoints.server import make_server, run_server, tune_gc
    from clawr1.entrypoints.workers import Workers, load_engine_from, socket_of
    from clawr1.gateway.app import create_app

    note = check_exposure(config)
    if config.gateway.workers > 1 and (engine is not None or pool is not None):
        raise ValueError("gateway.workers > 1 runs every worker on the configured engine and pool; "
                         "under Ray, scale the engine with ray.replicas instead")
    gw = config.gateway
    crew = Workers(config, engine_spec) if gw.workers > 1 else None  # binds the port: before loading anything
    engine = engine or load_engine_from(engine_spec, config)
    pool = pool or open_pool(config)
    app = create_app(engine, pool, config, internal_key=crew.key if crew else None)
    tune_gc()

    def started(port: int) -> None:
        if on_ready is not None:
            on_ready(port, note)
        else:
            log.warning("gateway on %s:%d; %s", gw.host, port, note)

    jobs = workers(app.state.gateway) if workers else []
    if crew is None:
        server = make_server(app, gw.host, gw.port, tls_cert=gw.tls_cert, tls_key=gw.tls_key)
    else:  # worker 0 on its socket; the fronts own the port
        app.state.gateway.served_path().unlink(missing_ok=True)  # a past run's: followers wait for ours
        socket_of(config, 0).unlink(missing_ok=True)
        # The fronts keep idle connections 3 s; uvicorn's default keep-alive (5 s) outlasts that. Only
        # they reach the socket (this user's run dir): their X-Forwarded-* are the client's.
        server = make_server(app, uds=str(socket_of(config, 0)), proxy_headers=True,
                             forwarded_allow_ips="*")
        server.before_shutdown = crew.stop_fronts  # Ctrl+C: no new requests first, then drain

        async def fronts() -> None:
            started(await crew.ready())
            await crew.supervise()

        jobs.append(fronts())
    try:
        if crew is not None:
            crew.start()
        await run_server(server, jobs, on_started=started if crew is None else None)
    finally:
        if crew is not None:
            await asyncio.to_thread(crew.stop)
        await engine.close()
        pool.close()


def cmd_serve(args: argparse.Namespace, config: Config) -> int:
    def ready(port: int, note: str) -> None:
        url = f"{config.gateway.scheme}://{config.gateway.host}:{port}/v1"
        board = f"{config.gateway.scheme}://{config.gateway.host}:{port}/dashboard"
        say(config, f"[green]Claw-R1 gateway[/green] on {url} (model {config.engine.model}, data {config.data_dir}); "
            f"dashboard {board}; {note}", f"gateway on {url}; {note}", url=url, dashboard=board,
            model=config.engine.model, data_dir=config.data_dir)

    try:
        asyncio.run(serve(config, on_ready=ready))
    except (UnsafeBindError, ListenError) as exc:
        err_console.print(f"[red]error:[/red] {exc}")
        return 2
    except KeyboardInterrupt:
        pass
    return 0
