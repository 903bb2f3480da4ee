"""A live gateway on 127.0.0.1 (real uvicorn, real SQLite pool) for tests, and pool polling."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from clawr1.core.config import load_config
from clawr1.datapool import DataPool, open_pool
from clawr1.entrypoints.server import in_thread, make_server
from clawr1.gateway.app import create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_gateway(engine, data_dir: Path, *overrides: str, wrap_pool=None) -> Iterator[tuple[str, DataPool]]:
    """Serve `engine` on a free port until the block ends; yields (base_url, pool). `wrap_pool(pool)`:
    what the gateway gets instead of the pool (a fault injected in front of the real one)."""
    config = load_config(None, [f'data_dir="{data_dir}"', *overrides])
    pool = open_pool(config)  # the SQLite file in data_dir, or pool.backend = "postgres"
    served = wrap_pool(pool) if wrap_pool else pool
    server = make_server(create_app(engine, served, config))
    try:
        with in_thread(server, server.serve, name="test-gateway", start_timeout_s=20) as background:
            yield f"http://127.0.0.1:{background.port}", pool
    finally:
        pool.close()


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    """Poll until `predicate()` is truthy (recording happens after the reply); returns its value."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def steps_of(pool: DataPool, count: int, timeout: float = 10.0):
    """All stored steps once at least `count` are committed."""
    wait_for(lambda: pool.stats()["steps"] >= count, timeout, f"{count} steps")
    ids = [t["step_id"] for s in pool.sessions(limit=1000) for t in pool.show(s["session_id"], s["tenant"], "session")["steps"]]
    return pool.get_steps(ids)


def healthy(base: str) -> bool:
    """True once a gateway at `base` answers `/healthz`."""
    try:
        return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def interrupt(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Ctrl+C a `clawr1` process and wait for its clean exit; kill it if it does not come."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
