"""`gateway.workers` > 1: several gateway processes behind one port.

The process that runs `serve` is worker 0, the leader: it serves its share on a Unix socket, runs
the background jobs (the judge, the trainer's supervisor, the guard that decides what version
serves) and starts the rest, which it keeps running: the followers (`python -m
clawr1.entrypoints.workers`, worker 1..N-1, each serving on its own socket and following the
leader's versions) and the front processes (`entrypoints/front.py`, `gateway.fronts` of them), which
accept on the public port (bound by the leader, shared by them all) and route each request to the
worker holding its session. Sockets live in `<data_dir>/run/` (this user only); the followers get
the resolved config, secrets included, through a pipe; their output goes to `run/workers.log`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from clawr1.core.config import Config, to_toml
from clawr1.entrypoints.supervise import keep_running
from clawr1.gateway.dispatch import key_digest

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


class ListenError(RuntimeError):
    """The gateway's address cannot be bound (another process has the port, no permission, no such
    address, a socket path too long)."""


class Workers:
    """The followers and the front processes of one `serve`, started and kept running by the leader."""

    def __init__(self, config: Config, engine_factory: str | None = None):
        self.config, self.engine_factory = config, engine_factory
        gw = config.gateway
        longest = socket_of(config, gw.workers - 1)
        if len(str(longest).encode()) > 100:  # sun_path holds 108 bytes
            raise ListenError(f"the data dir's path is too long for the workers' Unix sockets ({longest}); "
                              "use a shorter data_dir")
        self.key = secrets.token_urlsafe(32)  # the front's key for `/internal/match`
        # The fronts check keys before reading bodies: they get the keys' HMACs under this run's key.
        keys = [*gw.api_keys, *(k for ks in config.tenants.keys.values() for k in ks),
                *([gw.admin_key] if gw.admin_key else [])]
        self.env = {**os.environ, "CLAWR1_INTERNAL_KEY": self.key,
                    "CLAWR1_KEY_DIGESTS": ",".join(key_digest(self.key, k) for k in keys)}
        # The followers' config, secrets included, goes through a pipe: nothing on disk to leak.
        self.config_text = to_toml(config, secrets=True).encode()
        folder = run_dir(config)
        self.log_path = folder / "workers.log"
        self.log: IO[bytes] = open(self.log_path, "ab")  # noqa: SIM115 - closed in `stop`
        # The port is bound here, once, without SO_REUSEPORT (a second gateway on it fails as one
        # process would), and every front accepts on this one socket. It listens only once the
        # fronts do (each calls listen with BACKLOG): until then a client is refused, not left
        # waiting on a port nothing answers yet. The address family as uvicorn picks it.
        self.listener = socket.socket(socket.AF_INET6 if ":" in gw.host else socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.listener.bind((gw.host, gw.port))
        except OSError as exc:  # in use, not ours to bind, no such address or name
            self.listener.close()
            raise ListenError(f"cannot listen on {gw.host}:{gw.port}: {exc.strerror or exc}") from exc
        self.followers: dict[int, subprocess.Popen] = {}
        self.fronts: dict[int, subprocess.Popen] = {}
        self.stopping = False
        self.drain_s = gw.request_timeout_s + 5  # a request in flight may run this long

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    def ready_file(self, n: int) -> Path:
        return run_dir(self.config) / f"front-{n}.port"

    def follower_argv(self, index: int) -> list[str]:
        argv = [sys.executable, "-m", "clawr1.entrypoints.workers", "--index", str(index)]
        return argv + (["--engine", self.engine_factory] if self.engine_factory else [])

    def front_argv(self, n: int) -> list[str]:
        gw = self.config.gateway
        argv = [sys.executable, "-m", "clawr1.entrypoints.front", "--fd", str(self.listener.fileno()),
                "--ready", str(self.ready_file(n)), "--max-body-bytes", str(gw.max_body_bytes),
                "--max-json-depth", str(gw.max_json_depth), "--drain-s", str(gw.request_timeout_s),
                "--send-timeout-s", str(gw.send_timeout_s),
                "--auth-failures-per-minute", str(gw.auth_failures_per_minute)]
        argv += [a for i in range(gw.workers) for a in ("--socket", str(socket_of(self.config, i)))]
        if gw.tls_cert is not None:
            argv += ["--tls-cert", str(gw.tls_cert), "--tls-key", str(gw.tls_key)]
        # A tenant named with no keys (`{acme = []}`) gives none: with none at all the gateway is
        # open, and the fronts face the browsers (until 2026-12-07 such a tenant skipped that).
        if not gw.api_keys and not any(self.config.tenants.keys.values()):
            argv.append("--no-keys")
        return argv

    def start(self) -> None:
        for i in range(1, self.config.gateway.workers):
            self.followers[i] = self._follower(i)
        for n in range(self.config.gateway.fronts):
            self.ready_file(n).unlink(missing_ok=True)
            self.fronts[n] = self._front(n)

    def _front(self, n: int) -> subprocess.Popen:
        return self._spawn(self.front_argv(n), pass_fds=(self.listener.fileno(),))

    def _follower(self, index: int) -> subprocess.Popen:
        process = self._spawn(self.follower_argv(index), stdin=subprocess.PIPE)
        assert process.stdin is not None
        try:
            process.stdin.write(self.config_text)  # ~30 KB fits the pipe's buffer; more waits for the read
            process.stdin.close()
        except BrokenPipeError:  # it died first; `ready` / `supervise` report it with its log
            pass
        return process

    def _spawn(self, argv: list[str], **options: Any) -> subprocess.Popen:
        # Their own session: a Ctrl+C reaches the leader only, which stops them in order (`stop`);
        # each stops by itself should the leader die (`orphaned`).
        return subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True, **options)

    async def ready(self, timeout_s: float = 600.0) -> int:
        """The port, once every front serves (each waits for every worker to answer). A process
        that exits meanwhile fails the start at once, with the end of its log."""
        deadline = time.monotonic() + timeout_s
        while not all(self.ready_file(n).exists() for n in self.fronts):
            for name, process in [*((f"front {n}", p) for n, p in self.fronts.items()),
                                  *((f"worker {i}", p) for i, p in self.followers.items())]:
                if process.poll() is not None:
                    raise RuntimeError(f"gateway {name} exited while starting; {self.log_path}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway workers did not start within {timeout_s:.0f} s; see {self.log_path}")
            await asyncio.sleep(0.05)
        return self.port

    def tail(self, chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    async def supervise(self) -> None:
        """A follower or front that exits is started again (a follower's sessions' next turns
        resume from the pool; a front accepts on the same socket the others do)."""
        async def watch(name: str, group: dict[int, subprocess.Popen], i: int, spawn: Callable[[int], subprocess.Popen]) -> None:
            if group[i].poll() is not None and not self.stopping:
                group[i] = await asyncio.to_thread(spawn, i)
            while group[i].poll() is None or self.stopping:  # stopping: they exit on purpose, none restarts
                await asyncio.sleep(1.0)
            raise RuntimeError(f"{name} exited with code {group[i].returncode} (see {self.log_path})")

        await asyncio.gather(*(
            keep_running(f"gateway {kind} {i}", partial(watch, f"gateway {kind} {i}", group, i, spawn), again_on_return=True)
            for kind, group, spawn in (("worker", self.followers, self._follower), ("front", self.fronts, self._front))
            for i in group))

    def stop_fronts(self) -> None:
        """No new connections (called as the leader's shutdown begins: the port closes at once);
        requests in flight through the fronts finish."""
        self.stopping = True
        self.listener.close()
        _stop(list(self.fronts.values()), self.drain_s)

    def stop(self) -> None:
        """After the leader drained: the fronts (if still up), then the followers (each drains)."""
        self.stop_fronts()
        _stop(list(self.followers.values()), self.drain_s)
        for path in [*(self.ready_file(n) for n in self.fronts),
                     *(socket_of(self.config, i) for i in range(self.config.gateway.workers))]:
            path.unlink(missing_ok=True)
        self.log.close()


def _stop(processes: list[subprocess.Popen], timeout_s: float) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()


_STARTED_BY = os.getppid()  # in a front or a follower: the leader (checked against, whenever it dies)


async def orphaned(poll_s: float = 1.0) -> None:
    """Return once the leader (this process's parent when it started) is gone."""
    while os.getppid() == _STARTED_BY:
        await asyncio.sleep(poll_s)
    log.error("the gateway's leader process is gone; stopping")


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
    server = make_server(app, uds=str(path), proxy_headers=True, forwarded_allow_ips="*")  # only the fronts reach it

    async def stop_when_orphaned() -> None:
        await orphaned()
        server.stop()  # uvicorn's graceful stop: what is in flight finishes

    try:
        await run_server(server, [stop_when_orphaned()])
    finally:
        await engine.close()
        pool.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one follower of gateway.workers (started by `clawr1 serve`/`up`; "
                                                 "its config, as TOML, on stdin)")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--engine", help="module:attribute building the engine (default: the configured one)")
    args = parser.parse_args(argv)
    from clawr1.entrypoints import logs
    from clawr1.entrypoints.console import err_console

    config = Config.model_validate(tomllib.loads(sys.stdin.read()))
    logs.configure(config.log_format, logs.secrets_of(config), console=err_console)  # secrets redacted
    try:
        asyncio.run(follow(config, args.index, args.engine))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
