"""Run the gateway: engine + pool + FastAPI app under uvicorn, bound to loopback by default."""

from __future__ import annotations

import asyncio
import ipaddress
import logging

import uvicorn

from clawr1.core.config import Config
from clawr1.datapool import SQLitePool
from clawr1.engine import load_engine
from clawr1.gateway.app import create_app

log = logging.getLogger(__name__)


class UnsafeBindError(ValueError):
    """Binding a non-loopback address without API keys would expose an open model server."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(config: Config) -> str:
    """Refuse to expose an unauthenticated gateway; say how it is protected."""
    gw = config.gateway
    if not gw.api_keys:
        if not is_loopback(gw.host):
            raise UnsafeBindError(f"refusing to bind {gw.host} without API keys: set gateway.api_keys or bind 127.0.0.1")
        return f"no API keys configured: serving on {gw.host} (loopback) only"
    return f"{len(gw.api_keys)} API key(s) required"


async def serve(config: Config, on_ready=None) -> None:
    """Serve until cancelled or interrupted."""
    note = check_exposure(config)
    engine = load_engine(config)
    pool = SQLitePool(config.data_dir, config.pool)
    app = create_app(engine, pool, config)
    server = uvicorn.Server(uvicorn.Config(app, host=config.gateway.host, port=config.gateway.port,
                                           log_level="warning", access_log=False))
    log.warning("%s", note)
    try:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if on_ready is not None and server.started:
            port = server.servers[0].sockets[0].getsockname()[1]
            on_ready(port, note)
        await task
    finally:
        await engine.close()
        pool.close()
