"""The front process of `gateway.workers` > 1: it owns the public port and hands each request, bytes
unchanged, to the gateway worker that holds its session (`gateway/dispatch.py`), over the workers'
Unix sockets; replies (streams included) come back as they are produced. It authenticates
nothing and stores nothing: the worker does both, as with one process.

`python -m clawr1.entrypoints.front --port P --socket run/gateway-0.sock --socket ...` (the
internal key in `CLAWR1_INTERNAL_KEY`); it writes the port it listens on to `--ready` once every
worker answers.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import signal
import ssl
import time
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, ClientTimeout, UnixConnector, web

from clawr1.entrypoints.workers import unless_orphaned
from clawr1.gateway.body import parse_json
from clawr1.gateway.dispatch import Route, route
from clawr1.gateway.errors import APIError, error_body
from clawr1.gateway.internal import KEY_HEADER, PATH_HEADER

log = logging.getLogger("clawr1.front")
# Per-hop headers (RFC 9110 7.6.1) and the ones aiohttp writes itself for the body it sends.
HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
                 "content-length", "host"})


class Front:
    def __init__(self, sockets: list[Path], max_body_bytes: int, max_json_depth: int, internal_key: str):
        self.sockets, self.max_body, self.max_depth = sockets, max_body_bytes, max_json_depth
        self.internal_key = internal_key
        self.clients: list[ClientSession] = []
        self.turns = itertools.count()

    async def start(self, wait_s: float) -> None:
        """One connection pool per worker; returns once every worker answers `/healthz`."""
        timeout = ClientTimeout(total=None, sock_connect=10)  # requests last as long as the worker lets them
        self.clients = [ClientSession(connector=UnixConnector(path=str(s), limit=0), timeout=timeout,
                                      auto_decompress=False) for s in self.sockets]
        deadline = time.monotonic() + wait_s
        for i, client in enumerate(self.clients):
            while True:
                try:
                    async with client.get("http://worker/healthz") as response:
                        if response.status == 200:
                            break
                except OSError:  # not listening yet (aiohttp's connection errors are OSErrors)
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gateway worker {i} did not answer on {self.sockets[i]} within {wait_s:.0f} s")
                await asyncio.sleep(0.1)

    async def close(self) -> None:
        for client in self.clients:
            await client.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        declared = request.content_length
        if declared is not None and declared > self.max_body:
            return _error(APIError(413, f"request body of {declared} bytes exceeds the limit of {self.max_body}",
                                   code="request_too_large"))
        raw = await request.content.read(self.max_body + 1)
        if len(raw) > self.max_body:
            return _error(APIError(413, f"request body exceeds the limit of {self.max_body} bytes",
                                   code="request_too_large"))
        body = None
        if raw and request.method == "POST":
            try:
                body = parse_json(raw, self.max_depth)
            except APIError:
                body = None  # the worker it goes to answers the same 400
        headers = {k.lower(): v for k, v in request.headers.items()}
        where = route(request.method, request.path, headers, body, len(self.clients), next(self.turns))
        if request.path == "/metrics" and request.query.get("worker", "").isdigit():
            where = Route(int(request.query["worker"]) % len(self.clients))  # one worker's own counters
        worker = await self._holder(request, raw) if where.ask else None
        return await self._forward(request, raw, where.worker if worker is None else worker)

    async def _holder(self, request: web.Request, raw: bytes) -> int | None:
        """The worker whose history matcher holds the session of a compacted conversation, if any."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        headers.update({KEY_HEADER: self.internal_key, PATH_HEADER: request.path})

        async def ask(client: ClientSession) -> bool:
            async with client.post("http://worker/internal/match", data=raw, headers=headers) as response:
                return response.status == 200 and (await response.json()).get("session_id") is not None

        answers = await asyncio.gather(*(ask(c) for c in self.clients), return_exceptions=True)
        for i, answer in enumerate(answers):
            if isinstance(answer, BaseException):
                log.warning("worker %d could not say whether it holds a session: %r", i, answer)
            elif answer:
                return i
        return None

    async def _forward(self, request: web.Request, raw: bytes, worker: int) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        try:
            upstream = await self.clients[worker].request(request.method, "http://worker" + request.path_qs,
                                                          headers=headers, data=raw)
        except OSError as exc:  # nothing reached the worker: nothing was run or stored
            log.error("gateway worker %d is unreachable: %r", worker, exc)
            return _error(APIError(503, f"gateway worker {worker} is restarting; retry shortly",
                                   code="worker_unavailable"))
        async with upstream:
            out = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP}
            if upstream.content_length is not None and "text/event-stream" not in upstream.headers.get("content-type", ""):
                return web.Response(status=upstream.status, body=await upstream.read(), headers=out)
            response = web.StreamResponse(status=upstream.status, headers=out)
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response


def _error(exc: APIError) -> web.Response:
    return web.Response(status=exc.status, content_type="application/json",
                        text=json.dumps(error_body(exc.status, exc.message, param=exc.param, code=exc.code)))


async def serve(front: Front, host: str, port: int, ready: Path | None, tls: tuple[str, str] | None,
                wait_s: float) -> None:
    await front.start(wait_s)
    app = web.Application(client_max_size=front.max_body + 1)
    app.router.add_route("*", "/{tail:.*}", front.handle)
    # A client that goes away cancels its handler, which closes the worker's connection: the worker
    # then stops generating and stores the step `aborted`, as when the client talks to it directly.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    context = None
    if tls is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(*tls)
    # SO_REUSEPORT: `gateway.fronts` processes listen on the one port; the kernel spreads connections.
    site = web.TCPSite(runner, host, port, ssl_context=context, backlog=2048, reuse_port=True)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # port 0: the one given
    if ready is not None:
        tmp = ready.with_name(ready.name + ".tmp")
        tmp.write_text(str(bound))
        tmp.replace(ready)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await front.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--socket", type=Path, action="append", required=True, help="a worker's Unix socket, in order")
    parser.add_argument("--ready", type=Path, help="write the bound port here once serving")
    parser.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    parser.add_argument("--max-json-depth", type=int, default=64)
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    parser.add_argument("--wait-s", type=float, default=600.0, help="how long the workers may take to start")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s front %(levelname)s %(message)s")
    front = Front(args.socket, args.max_body_bytes, args.max_json_depth, os.environ["CLAWR1_INTERNAL_KEY"])
    tls = (args.tls_cert, args.tls_key) if args.tls_cert else None
    loop_policy: Any = None
    try:
        import uvloop

        loop_policy = uvloop.EventLoopPolicy()
    except ImportError:
        pass  # plain asyncio: slower, same behaviour
    if loop_policy is not None:
        asyncio.set_event_loop_policy(loop_policy)
    asyncio.run(unless_orphaned(serve(front, args.host, args.port, args.ready, tls, args.wait_s)))


if __name__ == "__main__":
    main()
