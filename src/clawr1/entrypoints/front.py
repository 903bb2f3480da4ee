"""A front process of `gateway.workers` > 1: it accepts on the public port (a listening socket the
leader bound and hands to every front) and passes each request, bytes unchanged, to the gateway
worker that holds its session (`gateway/dispatch.py`), over the workers' Unix sockets; replies
(streams included) come back as they are produced. It stores nothing.

With agent keys it checks the caller's key before it reads a byte of the body: an agent or the
admin key (it holds their HMACs under the internal key, never the keys), or a per-session key,
which the worker holding it checks against the pool; one a worker said is unknown is remembered
(bounded), so a guess is refused at once the next time. Failed checks count per client address
(`gateway.auth_failures_per_minute`, `throttle.py`). The worker checks every request again (the
front only turns the obvious away early). A write to a client that takes no data waits at most
`--send-timeout-s`.

`python -m clawr1.entrypoints.front --fd N --socket run/gateway-0.sock --socket ...` (the internal
key in `CLAWR1_INTERNAL_KEY`, the keys' HMACs in `CLAWR1_KEY_DIGESTS`); it writes the port to
`--ready` once every worker answers.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import signal
import socket
import ssl
import time
from collections import OrderedDict
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from aiohttp import ClientConnectionError, ClientError, ClientSession, ClientTimeout, UnixConnector, web
from multidict import CIMultiDict
from prometheus_client import CONTENT_TYPE_LATEST

from clawr1.entrypoints.workers import orphaned
from clawr1.gateway.body import parse_json
from clawr1.gateway.browsers import refusal
from clawr1.gateway.dispatch import KEY_HEADER, PATH_HEADER, Route, bearer, key_digest, route
from clawr1.gateway.errors import APIError, anthropic_error_body, error_body
from clawr1.gateway.metrics import merge_workers
from clawr1.gateway.sessions import SESSION_KEY_PREFIXES, UNKNOWN_SESSION_KEY
from clawr1.gateway.throttle import Throttle

log = logging.getLogger("clawr1.front")
# Per-hop headers (RFC 9110 7.6.1), the ones aiohttp writes itself for the body it sends, and the
# front's own to a worker (a client's copy of those is dropped, whatever its case).
DROP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
                  "content-length", "host", KEY_HEADER, PATH_HEADER})
FORWARDED = ("x-forwarded-for", "x-forwarded-proto")  # set by the front: the worker sees the client's
LOOPBACK = ("127.0.0.1", "::1")  # a proxy in front of us there is trusted with its own, as uvicorn does
BACKLOG = 2048  # connections the kernel queues on the shared port before a front accepts them
ASK_TIMEOUT_S = 5.0  # how long the workers may take to say who holds a compacted conversation
HEADER_LIMIT = 65536  # request line and header field sizes accepted (aiohttp's default is 8 KiB)
REFUSED_KEYS = 65_536  # per-session keys a worker said are unknown, remembered (oldest dropped first)
# Answered without a key by the workers (the dashboard asks for its own sign-in): not checked here.
KEYLESS = ("/healthz", "/openapi.json", "/dashboard")


class Front:
    def __init__(self, sockets: list[Path], max_body_bytes: int, max_json_depth: int, internal_key: str,
                 refuse_pages: bool = False, keys: frozenset[str] | None = None, send_timeout_s: float = 30.0,
                 auth_failures_per_minute: int = 30):
        """`refuse_pages`: the gateway has no keys; the front faces the browsers, so it refuses
        what `browsers.refusal` refuses (the workers behind it see only the front). `keys`: the
        `key_digest`s of every agent key and the admin key, None when the gateway has no agent
        keys (then only the workers check what they check)."""
        self.sockets, self.max_body, self.max_depth = sockets, max_body_bytes, max_json_depth
        self.internal_key = internal_key
        self.refuse_pages = refuse_pages
        self.keys, self.send_timeout_s = keys, send_timeout_s
        self.refused: OrderedDict[str, None] = OrderedDict()  # digests of per-session keys a worker refused
        self.throttle = Throttle(auth_failures_per_minute)
        self.clients: list[ClientSession] = []
        self.turns = itertools.count()

    async def start(self, wait_s: float) -> None:
        """One connection pool per worker; returns once every worker answers `/healthz`."""
        timeout = ClientTimeout(total=None, sock_connect=10)  # requests last as long as the worker lets them
        # Idle connections are dropped before the worker's keep-alive ends (uvicorn: 5 s), so a request
        # never goes out on a connection the worker is closing.
        self.clients = [ClientSession(connector=UnixConnector(path=str(s), limit=0, keepalive_timeout=3),
                                      timeout=timeout, auto_decompress=False) for s in self.sockets]
        deadline = time.monotonic() + wait_s
        for i, client in enumerate(self.clients):
            while True:
                try:
                    async with client.get("http://worker/healthz") as response:
                        if response.status == 200:
                            break
                except (OSError, ClientConnectionError):  # not listening yet
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gateway worker {i} did not answer on {self.sockets[i]} within {wait_s:.0f} s")
                await asyncio.sleep(0.1)

    async def close(self) -> None:
        for client in self.clients:
            await client.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            headers = {k.lower(): v for k, v in request.headers.items()}
            if self.refuse_pages:
                refused = refusal(request.method, headers)
                if refused is not None:
                    raise refused
            self._check_key(request, headers)  # before a byte of the body is read
            raw = await self._body(request)
            body = None
            if raw and request.method == "POST":
                try:
                    body = parse_json(raw, self.max_depth)
                except APIError:
                    body = None  # the worker it goes to answers the same 400
            where = route(request.method, request.path, headers, body, len(self.clients), next(self.turns))
            if request.path == "/metrics" and request.method == "GET":
                if "worker" not in request.query:
                    return await self._metrics(request)
                where = Route(self._worker_param(request.query["worker"]))  # one worker's own counters
            worker = await self._holder(request, raw) if where.ask else None
            return await self._forward(request, raw, where.worker if worker is None else worker)
        except APIError as exc:
            return _error(exc, request.path)

    def _check_key(self, request: web.Request, headers: dict[str, str]) -> None:
        """With agent keys: an agent or admin key, or a per-session key no worker refused yet,
        else 401 (and a failure counted against the client)."""
        if self.keys is None or request.path.startswith(KEYLESS):
            return
        client = _client(request)
        if self.throttle.blocked:
            self.throttle.check(client)
        token = bearer(headers)
        digest = key_digest(self.internal_key, token)
        if token.startswith(SESSION_KEY_PREFIXES):
            if digest not in self.refused:
                return  # the worker holding it checks it against the pool
        elif digest in self.keys:
            return
        self.throttle.failed(client)
        raise APIError(401, UNKNOWN_SESSION_KEY if token.startswith(SESSION_KEY_PREFIXES) else
                       "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key")

    def _refused(self, request: web.Request, status: int, body: bytes) -> None:
        """Remember a per-session key a worker answered as unknown (`UNKNOWN_SESSION_KEY`)."""
        token = bearer({k.lower(): v for k, v in request.headers.items()})
        if self.keys is not None and status == 401 and token.startswith(SESSION_KEY_PREFIXES) \
                and UNKNOWN_SESSION_KEY.encode() in body:
            self.refused[key_digest(self.internal_key, token)] = None
            if len(self.refused) > REFUSED_KEYS:
                self.refused.popitem(last=False)

    async def _body(self, request: web.Request) -> bytes:
        """The whole body, at most `max_body` bytes (413 beyond, without reading the rest)."""
        declared = request.content_length
        if declared is not None and declared > self.max_body:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {self.max_body}",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > self.max_body:
                raise APIError(413, f"request body exceeds the limit of {self.max_body} bytes", code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def _worker_param(self, value: str) -> int:
        if not value.isdigit() or int(value) >= len(self.clients):
            raise APIError(400, f"worker must be 0..{len(self.clients) - 1}", param="worker")
        return int(value)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        """Every worker's `/metrics` as one (`metrics.merge_workers`); a worker's refusal (the
        scrape's key) is answered as it is."""
        async def scrape(client: ClientSession) -> tuple[int, bytes]:
            async with client.get("http://worker/metrics", headers=_forwarded(request)) as response:
                return response.status, await response.read()

        try:
            answers = await asyncio.gather(*(scrape(c) for c in self.clients))
        except ClientConnectionError as exc:
            raise APIError(502, f"a gateway worker did not answer the scrape: {exc}", code="worker_unavailable") from exc
        for status, body in answers:
            if status != 200:
                return web.Response(status=status, body=body, content_type="application/json")
        merged = merge_workers([body.decode() for _, body in answers])
        return web.Response(body=merged, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _holder(self, request: web.Request, raw: bytes) -> int | None:
        """The worker whose history matcher holds the session of a compacted conversation, if any."""
        headers = _forwarded(request)
        headers.update({KEY_HEADER: self.internal_key, PATH_HEADER: request.path})

        async def ask(client: ClientSession) -> bool:
            async with asyncio.timeout(ASK_TIMEOUT_S), client.post("http://worker/internal/match", data=raw,
                                                                   headers=headers) as response:
                return response.status == 200 and (await response.json()).get("session_id") is not None

        answers = await asyncio.gather(*(ask(c) for c in self.clients), return_exceptions=True)
        for i, answer in enumerate(answers):
            if isinstance(answer, BaseException):  # that worker is taken as not holding it
                log.warning("worker %d could not say whether it holds a session: %r", i, answer)
            elif answer:
                return i
        return None

    async def _forward(self, request: web.Request, raw: bytes, worker: int) -> web.StreamResponse:
        try:
            upstream = await self.clients[worker].request(request.method, "http://worker" + request.path_qs,
                                                          headers=_forwarded(request), data=raw)
        except ClientConnectionError as exc:  # a worker restarting, or one that died with the request
            log.error("gateway worker %d did not answer: %r", worker, exc)
            raise APIError(502, f"gateway worker {worker} did not answer; retry shortly",
                           code="worker_unavailable") from exc
        async with upstream:
            out = CIMultiDict((k, v) for k, v in upstream.headers.items() if k.lower() not in DROP)
            if upstream.content_length is not None and "text/event-stream" not in upstream.headers.get("content-type", ""):
                try:
                    body = await upstream.read()
                except ClientError as exc:  # the worker died while answering (it may have run it)
                    raise APIError(502, f"gateway worker {worker} failed while answering", code="worker_unavailable") from exc
                self._refused(request, upstream.status, body)
                return web.Response(status=upstream.status, body=body, headers=out)
            response = web.StreamResponse(status=upstream.status, headers=out)
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    # A client that takes nothing would hold this handler (and the worker's stream
                    # behind it) for ever: past the timeout it is dropped, and leaving `upstream`
                    # hangs up on the worker, which stops the work and stores the step `aborted`.
                    async with asyncio.timeout(self.send_timeout_s):
                        await response.write(chunk)
            except TimeoutError:
                log.warning("a client of %s took no data for %s s; dropped", request.path, self.send_timeout_s)
                if request.transport is not None:
                    request.transport.close()
                return response
            await response.write_eof()
            return response


def _forwarded(request: web.Request) -> CIMultiDict[str]:
    """The client's headers for the worker: repeated ones kept, per-hop and the front's own
    dropped, and who the client is and whether it came over TLS (the worker's uvicorn takes those
    from its socket's only peer, the front: the dashboard's cookie is `Secure` behind TLS)."""
    headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in DROP)
    if request.remote not in LOOPBACK or not all(name in headers for name in FORWARDED):
        for name in FORWARDED:
            headers.popall(name, None)
        headers["X-Forwarded-For"] = request.remote or ""
        headers["X-Forwarded-Proto"] = "https" if request.secure else "http"
    return headers


def _client(request: web.Request) -> str | None:
    """The client's address, as `_forwarded` tells the worker (a loopback proxy's word taken)."""
    if request.remote in LOOPBACK and "x-forwarded-for" in request.headers:
        return request.headers["x-forwarded-for"].split(",")[0].strip()
    return request.remote


def _error(exc: APIError, path: str) -> web.Response:
    """In the shape the route's clients read: Anthropic's on `/v1/messages`, OpenAI's elsewhere."""
    if path.endswith("/v1/messages"):
        body = anthropic_error_body(exc.status, exc.message, exc.code)
    else:
        body = error_body(exc.status, exc.message, param=exc.param, code=exc.code)
    return web.Response(status=exc.status, content_type="application/json", text=json.dumps(body))


async def serve(front: Front, listener: socket.socket, ready: Path | None, tls: tuple[str, str] | None,
                wait_s: float, stop: asyncio.Event, drain_s: float = 60.0) -> None:
    """Accept on `listener` until `stop` is set, then let requests in flight finish (up to
    `drain_s`); `ready` gets the port once every worker answers."""
    await front.start(wait_s)
    app = web.Application(client_max_size=front.max_body + 1)
    app.router.add_route("*", "/{tail:.*}", front.handle)
    # A client that goes away cancels its handler, which closes the worker's connection: the worker
    # then stops generating and stores the step `aborted`, as when the client talks to it directly.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=drain_s,
                           max_line_size=HEADER_LIMIT, max_field_size=HEADER_LIMIT)
    await runner.setup()
    context = None
    if tls is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(*tls)
    await web.SockSite(runner, listener, ssl_context=context, backlog=BACKLOG).start()
    if ready is not None:
        tmp = ready.with_name(ready.name + ".tmp")
        tmp.write_text(str(listener.getsockname()[1]))
        tmp.replace(ready)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()  # in-flight requests finish (the workers are still up)
        await front.close()


async def unless_orphaned(main: Coroutine[Any, Any, None]) -> None:
    """Run `main` (the front's life) until it ends or the leader is gone, whichever comes first,
    starting up included (the wait for the workers): a killed leader leaves nothing behind on the
    port. (A follower, which serves nothing until it has started, stops gracefully: `workers.follow`.)"""
    task, watch = asyncio.ensure_future(main), asyncio.ensure_future(orphaned())
    await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    for each in (task, watch):
        each.cancel()
    await asyncio.gather(task, watch, return_exceptions=True)
    if task.done() and not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


async def _main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    digests = os.environ.get("CLAWR1_KEY_DIGESTS")
    front = Front(args.socket, args.max_body_bytes, args.max_json_depth, os.environ["CLAWR1_INTERNAL_KEY"],
                  refuse_pages=args.no_keys, keys=None if args.no_keys or digests is None else
                  frozenset(filter(None, digests.split(","))), send_timeout_s=args.send_timeout_s,
                  auth_failures_per_minute=args.auth_failures_per_minute)
    listener = socket.socket(fileno=args.fd)  # bound and listening: the leader's
    tls = (args.tls_cert, args.tls_key) if args.tls_cert else None
    await unless_orphaned(serve(front, listener, args.ready, tls, args.wait_s, stop, args.drain_s))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fd", type=int, required=True, help="the listening socket, inherited from the leader")
    parser.add_argument("--socket", type=Path, action="append", required=True, help="a worker's Unix socket, in order")
    parser.add_argument("--ready", type=Path, help="write the port here once serving")
    parser.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    parser.add_argument("--max-json-depth", type=int, default=64)
    parser.add_argument("--no-keys", action="store_true", help="the gateway has no agent keys: refuse web pages")
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    parser.add_argument("--wait-s", type=float, default=600.0, help="how long the workers may take to start")
    parser.add_argument("--drain-s", type=float, default=600.0, help="how long requests in flight may finish on a stop")
    parser.add_argument("--send-timeout-s", type=float, default=30.0, help="longest a write may wait for the client")
    parser.add_argument("--auth-failures-per-minute", type=int, default=30, help="failed key checks per address")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s front %(levelname)s %(message)s")
    loop_policy: Any = None
    try:
        import uvloop

        loop_policy = uvloop.EventLoopPolicy()
    except ImportError:
        pass  # plain asyncio: slower, same behaviour
    if loop_policy is not None:
        asyncio.set_event_loop_policy(loop_policy)
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
