"""Engine + gateway + reward worker in this process, on 127.0.0.1 and a free port, for the length
of an offline run (`train-flow`, `run-agent --serve`).

The gateway is the real one (`create_app`, under uvicorn in a background thread), so flows and
agents are recorded exactly as in production; only the trainer differs by mode. A reward worker
that dies stops the gateway and its error is raised here, never swallowed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from clawr1.core.config import Config
from clawr1.datapool import DataPool, open_pool
from clawr1.engine import load_engine
from clawr1.engine.base import Engine
from clawr1.gateway.app import create_app
from clawr1.reward.types import Judge
from clawr1.reward.worker import RewardWorker

START_TIMEOUT_S = 300.0  # converting the embedded model on first use takes a while


@dataclass
class Served:
    root: str  # http://127.0.0.1:PORT
    pool: DataPool
    engine: Engine
    api_key: str | None  # what agents send (the first `gateway.api_keys`, if any)
    failures: list[BaseException] = field(default_factory=list)

    def check(self) -> None:
        """Raise the error of a background job (the server, the reward worker) that died."""
        if self.failures:
            raise self.failures[0]


@contextlib.contextmanager
def serve_in_process(config: Config, *, judge: Judge | None = None, reward: bool = True) -> Iterator[Served]:
    """Serve `config`'s model until the block ends. `judge` replaces the configured judge (tests);
    `reward=False` runs no reward worker."""
    config = config.model_copy(deep=True)
    config.gateway.host = "127.0.0.1"  # an offline run is never exposed, whatever the config says
    engine = load_engine(config)
    try:
        pool = open_pool(config)
    except BaseException:
        asyncio.run(engine.close())
        raise
    app = create_app(engine, pool, config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False))
    served = Served("", pool, engine, config.gateway.api_keys[0] if config.gateway.api_keys else None)

    async def main() -> None:
        jobs = [asyncio.create_task(RewardWorker(pool, engine, config, judge=judge).run())] if reward else []
        serving = asyncio.create_task(server.serve())
        try:
            while not serving.done():
                done, _ = await asyncio.wait([serving, *jobs], return_when=asyncio.FIRST_COMPLETED)
                for job in done - {serving}:
                    jobs.remove(job)
                    if not job.cancelled() and job.exception() is not None:
                        served.failures.append(job.exception())  # type: ignore[arg-type]
                        server.should_exit = True
            await serving
        finally:
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            await engine.close()

    # The future keeps the server thread's own error for this thread to raise.
    running: Future[None] = Future()
    thread = threading.Thread(target=_run, args=(main, running), name="clawr1-offline-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while not server.started:
            served.check()
            if running.done():
                running.result()  # raises what stopped it
                raise RuntimeError("the in-process gateway stopped before it started")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the in-process gateway did not start within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        served.root = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        yield served
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        pool.close()
    served.check()
    if running.done():
        running.result()


def _run(main: Callable[[], Coroutine[Any, Any, None]], running: Future[None]) -> None:
    if running.set_running_or_notify_cancel():
        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - handed over; the caller's thread raises it
            running.set_exception(exc)
        else:
            running.set_result(None)


def wait_judged(served: Served, session_ids: list[str], timeout_s: float) -> None:
    """Until every main turn with a next state in these sessions carries a reward (0 included) or
    the judge gave up on it (`reward.max_judge_attempts`).

    Raises:
        TimeoutError: the judge did not get through them in time (it logs why it failed).
    """
    deadline = time.monotonic() + timeout_s
    waiting = list(session_ids)
    while waiting:
        served.check()
        waiting = [s for s in waiting if any(t["turn_type"] == "main" and t["next_step_id"] and t["reward"] is None
                                             and t["status"] == "pending" and t["judge_gave_up_at"] is None
                                             for t in _steps(served, s))]
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"{len(waiting)} sessions still have unjudged turns after {timeout_s:.0f} s "
                               f"(e.g. {waiting[0]}); is the judge failing? see the log")
        if waiting:
            time.sleep(0.1)


def _steps(served: Served, session_id: str) -> list[dict]:
    try:
        return served.pool.show(session_id)["steps"]
    except KeyError:  # the rollout never called the model: no session, nothing to judge
        return []
