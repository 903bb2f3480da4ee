"""The one way to run an ASGI app under uvicorn with background jobs: `run_server` in the caller's
event loop (`clawr1 serve`, `clawr1 up`, the Ray head, the benchmarks' gateway processes), or
`in_thread` on a thread of its own (the offline runners, the tests' live gateway).

A background job (the reward worker, a supervisor) shares the app's loop; one that dies takes the
server down and its error propagates, so a broken judge never leaves a gateway that records
feedback nobody scores. The jobs are cancelled when the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn


def tune_gc() -> None:
    """The model's long-lived objects never need scanning again, and per-request garbage is
    acyclic, so rarer young-generation collections cost nothing (p99 at 64 clients measured
    336 -> 111 ms with both)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


class Server(uvicorn.Server):
    """uvicorn's server, plus `stop()`: a stop asked from another thread is taken at once, not at
    uvicorn's next 0.1 s tick (the tests start and stop ~120 gateways; each waited ~50 ms for it).
    A signal (Ctrl+C) stops it as uvicorn does."""

    _wake: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    before_shutdown: Callable[[], None] | None = None
    """Run (in a thread) as the shutdown begins, before uvicorn stops accepting and drains: the
    front processes of `gateway.workers` stop taking requests first."""

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        if self.before_shutdown is not None:
            await asyncio.to_thread(self.before_shutdown)
        await super().shutdown(sockets)

    async def main_loop(self) -> None:
        # uvicorn's loop (`on_tick` every 0.1 s: the date header, `should_exit`), woken by `stop()`.
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864_000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):  # not wait_for: it can swallow a cancellation
                    await self._wake.wait()

    def stop(self) -> None:
        """Stop serving (thread-safe): `should_exit`, and the main loop woken to see it."""
        self.should_exit = True
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # its loop has closed: the server is down already
                loop.call_soon_threadsafe(wake.set)


def make_server(app: Any, host: str = "127.0.0.1", port: int = 0, *, tls_cert: Path | None = None,
                tls_key: Path | None = None, **options: Any) -> Server:
    """A uvicorn server for `app` (port 0: a free one). Its records go to the root handler (rich or
    JSON, secrets redacted: `log_config=None`), no access log; `options` are uvicorn's (loop, http)."""
    # No proxy headers: nothing here reads the client's address, so uvicorn's middleware that would
    # rewrite it from `X-Forwarded-For` (trusted from any local process) is only a layer a request.
    settings: dict[str, Any] = {"log_level": "warning", "access_log": False, "log_config": None,
                                "proxy_headers": False, **options}
    if tls_cert is not None:
        settings.update(ssl_certfile=str(tls_cert), ssl_keyfile=str(tls_key))
    return Server(uvicorn.Config(app, host=host, port=port, **settings))


def port_of(server: uvicorn.Server) -> int:
    """The port a started server listens on (the free one it was given for port 0)."""
    return server.servers[0].sockets[0].getsockname()[1]


async def run_server(server: Server, jobs: list[Coroutine[Any, Any, None]] | None = None,
                     on_started: Callable[[int], None] | None = None) -> None:
    """Serve until the server stops (a signal, `should_exit`); `on_started(port)` once it listens.
    A background job that raises stops the server and its error is raised here."""
    tasks = [asyncio.create_task(job) for job in jobs or []]
    try:
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started and on_started is not None:
            on_started(port_of(server))
        running = set(tasks)
        while not serving.done():
            done, _ = await asyncio.wait([serving, *running], return_when=asyncio.FIRST_COMPLETED)
            for job in done - {serving}:
                running.discard(job)
                if not job.cancelled() and job.exception() is not None:
                    server.stop()
                    await serving
                    raise job.exception()  # type: ignore[misc]
        await serving
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Background:
    """A server running on its own thread: where it listens, and the error that stopped it."""

    port: int
    stopped: Future[None]

    def check(self) -> None:
        """Raise the error that stopped the server or one of its jobs, if any."""
        if self.stopped.done():
            self.stopped.result()


@contextlib.contextmanager
def in_thread(server: Server, main: Callable[[], Coroutine[Any, Any, None]], *, name: str,
              start_timeout_s: float = 300.0) -> Iterator[Background]:
    """Run `main()` (which serves `server`, usually through `run_server`) in a thread with its own
    event loop until the block ends; yields once `server` listens. A `main` that fails before that
    raises here; after that, `Background.check()` raises its error, as does leaving the block."""
    stopped: Future[None] = Future()
    thread = threading.Thread(target=_run, args=(main, stopped), name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    try:
        while not server.started:
            if stopped.done():
                stopped.result()  # raises what stopped it
                raise RuntimeError(f"{name} stopped before it started")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start within {start_timeout_s:.0f} s")
            time.sleep(0.005)
        background = Background(port_of(server), stopped)
        yield background
    finally:
        server.stop()
        thread.join(timeout=60)
    background.check()


def _run(main: Callable[[], Coroutine[Any, Any, None]], stopped: Future[None]) -> None:
    if stopped.set_running_or_notify_cancel():
        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - handed over; the caller's thread raises it
            stopped.set_exception(exc)
        else:
            stopped.set_result(None)
