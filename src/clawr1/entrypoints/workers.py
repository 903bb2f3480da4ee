"""`gateway.workers` > 1: several gateway processes behind one port.

The process that runs `serve` is worker 0, the leader: it serves its share on a Unix socket, runs
the background jobs (the judge, the trainer's supervisor, the guard that decides what version
serves) and starts the rest, which it keeps running: the followers (`python -m
clawr1.entrypoints.workers`, worker 1..N-1, each serving on its own socket and following the
leader's versions) and the front process (`entrypoints/front.py`), which owns the public port and
routes each request to the worker holding its session (`gateway.fronts` of them share the port).
Sockets live in `<data_dir>/run/` (this
user only); the followers read the resolved config, secrets included, from a file only this user
can read, removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from clawr1.core.config import Config, load_config, to_toml
from clawr1.entrypoints.supervise import keep_running

if TYPE_CHECKING:
    from clawr1.engine import Engine

log = logging.getLogger(__name__)


def run_dir(config: Config) -> Path:
    path = Path(config.data_dir) / "run"
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)  # the sockets speak for any agent key: this user's only
    return path


def socket_of(config: Config, index: int) -> Path:
    return run_dir(config) / f"gateway-{index}.sock"


class Workers:
    """The followers and the front process of one `serve`, started and kept running by the leader."""

    def __init__(self, config: Config, engine_factory: str | None = None):
        self.config, self.engine_factory = config, engine_factory
        self.key = secrets.token_urlsafe(32)  # the front's key for `/internal/match`
        self.env = {**os.environ, "CLAWR1_INTERNAL_KEY": self.key}
        folder = run_dir(config)
        with tempfile.NamedTemporaryFile("w", suffix=".toml", dir=folder, delete=False) as f:  # mode 0600
            f.write(to_toml(config, secrets=True))
        self.config_file = Path(f.name)
        self.ready = folder / "front.port"
        self.ready.unlink(missing_ok=True)
        self.log: IO[bytes] = open(folder / "workers.log", "ab")  # noqa: SIM115 - closed in `stop`
        self.followers: dict[int, subprocess.Popen] = {}
        self.fronts: list[subprocess.Popen] = []

    def follower_argv(self, index: int) -> list[str]:
        argv = [sys.executable, "-m", "clawr1.entrypoints.workers", "--config", str(self.config_file),
                "--index", str(index)]
        return argv + (["--engine", self.engine_factory] if self.engine_factory else [])

    def start(self) -> None:
        """The followers, and the first front (the others need its port: `port`)."""
        for i in range(1, self.config.gateway.workers):
            self.followers[i] = self._spawn(self.follower_argv(i))
        self.fronts.append(self._spawn(self.front_argv(self.config.gateway.port, self.ready)))

    def front_argv(self, port: int, ready: Path | None) -> list[str]:
        gw = self.config.gateway
        argv = [sys.executable, "-m", "clawr1.entrypoints.front", "--host", gw.host, "--port", str(port),
                "--max-body-bytes", str(gw.max_body_bytes), "--max-json-depth", str(gw.max_json_depth)]
        argv += [a for i in range(gw.workers) for a in ("--socket", str(socket_of(self.config, i)))]
        argv += ["--ready", str(ready)] if ready is not None else []
        if gw.tls_cert is not None:
            argv += ["--tls-cert", str(gw.tls_cert), "--tls-key", str(gw.tls_key)]
        return argv

    def _spawn(self, argv: list[str]) -> subprocess.Popen:
        # Their own session: a Ctrl+C reaches the leader only, which stops them in order (`stop`);
        # each stops by itself should the leader die (`orphaned`).
        return subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True)

    async def port(self, timeout_s: float = 600.0) -> int:
        """The port, once every front listens on it (the first waits for every worker to answer)."""
        port = await self._ready(self.ready, self.fronts[0], timeout_s)
        for n in range(1, self.config.gateway.fronts):
            ready = self.ready.with_name(f"front-{n}.port")
            ready.unlink(missing_ok=True)
            self.fronts.append(self._spawn(self.front_argv(port, ready)))
            await self._ready(ready, self.fronts[-1], timeout_s)
        return port

    async def _ready(self, ready: Path, front: subprocess.Popen, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if front.poll() is not None:
                raise RuntimeError(f"the gateway's front process exited; see {self.log.name}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway workers did not start within {timeout_s:.0f} s; see {self.log.name}")
            await asyncio.sleep(0.05)
        return int(ready.read_text())

    async def supervise(self) -> None:
        """A follower that exits is started again (its sessions' next turns resume from the pool);
        a front exiting stops the whole gateway (the port it held could be taken)."""
        async def follower(i: int) -> None:
            if self.followers[i].poll() is not None:
                self.followers[i] = await asyncio.to_thread(self._spawn, self.follower_argv(i))
            while self.followers[i].poll() is None:
                await asyncio.sleep(1.0)
            raise RuntimeError(f"gateway worker {i} exited with code {self.followers[i].returncode}")

        async def front() -> None:
            while all(f.poll() is None for f in self.fronts):
                await asyncio.sleep(1.0)
            raise RuntimeError(f"a gateway front process exited; see {self.log.name}")

        await asyncio.gather(front(), *(keep_running(f"gateway worker {i}", lambda i=i: follower(i),
                                                     again_on_return=True) for i in self.followers))

    def stop(self) -> None:
        """The fronts first (no new requests), then the followers (each drains as uvicorn does)."""
        for group in (self.fronts, list(self.followers.values())):
            for process in group:
                process.terminate()
            for process in group:
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
        self.config_file.unlink(missing_ok=True)
        for path in [self.ready, *self.ready.parent.glob("front-*.port"),
                     *(socket_of(self.config, i) for i in range(self.config.gateway.workers))]:
            path.unlink(missing_ok=True)
        self.log.close()


async def orphaned(poll_s: float = 1.0) -> None:
    """Return once this process's parent (the leader) is gone."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(poll_s)
    log.error("the gateway's leader process is gone; stopping")


async def unless_orphaned(main: Coroutine[Any, Any, None]) -> None:
    """Run `main` (a front's or a follower's life) until it ends or the leader is gone, whichever
    comes first, starting up included: a killed leader leaves nothing behind on the port."""
    task, watch = asyncio.ensure_future(main), asyncio.ensure_future(orphaned())
    await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    for each in (task, watch):
        each.cancel()
    await asyncio.gather(task, watch, return_exceptions=True)
    if task.done() and not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


def load_engine_from(spec: str | None, config: Config) -> Engine:
    """The configured engine, or `module:attribute()` (a benchmark's fake engine in every worker)."""
    if spec is None:
        from clawr1.engine import load_engine

        return load_engine(config)
    import importlib

    module, _, attribute = spec.partition(":")
    return getattr(importlib.import_module(module), attribute)()


async def follow(config: Config, index: int, engine_spec: str | None) -> None:
    """A follower's life: serve on its socket until told to stop."""
    from clawr1.datapool import open_pool
    from clawr1.entrypoints.server import make_server, run_server, tune_gc
    from clawr1.gateway.app import create_app

    engine = load_engine_from(engine_spec, config)
    pool = open_pool(config)
    path = socket_of(config, index)
    path.unlink(missing_ok=True)  # a socket left by a killed predecessor
    app = create_app(engine, pool, config, worker=index, internal_key=os.environ["CLAWR1_INTERNAL_KEY"])
    tune_gc()
    try:
        await run_server(make_server(app, uds=str(path)))
    finally:
        await engine.close()
        pool.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one follower of gateway.workers (started by `clawr1 serve`/`up`)")
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--engine", help="module:attribute building the engine (default: the configured one)")
    args = parser.parse_args(argv)
    from clawr1.cli import logs
    from clawr1.entrypoints.console import err_console

    config = load_config(args.config)
    logs.configure(config.log_format, logs.secrets_of(config), console=err_console)  # secrets redacted
    try:
        asyncio.run(unless_orphaned(follow(config, args.index, args.engine)))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
