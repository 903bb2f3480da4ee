"""Engine + gateway + reward worker in this process, on 127.0.0.1 and a free port, for the length
of an offline run (`train-flow`, `run-agent --serve`).

The gateway is the real one (`create_app`, under uvicorn on a thread: `entrypoints.server`), so flows and
agents are recorded exactly as in production; only the trainer differs by mode. A reward worker
that dies stops the gateway and its error is raised here, never swallowed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from clawr1.core.config import Config
from clawr1.datapool import DataPool, open_pool
from clawr1.engine import load_engine
from clawr1.engine.base import Engine
from clawr1.entrypoints.server import Background, in_thread, make_server, run_server
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
    background: Background | None = None  # the server's thread (None: served elsewhere)

    def check(self) -> None:
        """Raise the error of a background job (the server, the reward worker) that died."""
        if self.background is not None:
            self.background.check()


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
    server = make_server(create_app(engine, pool, config))

    async def main() -> None:
        try:
            await run_server(server, [RewardWorker(pool, engine, config, judge=judge).run()] if reward else [])
        finally:
            await engine.close()

    try:
        with in_thread(server, main, name="clawr1-offline-gateway", start_timeout_s=START_TIMEOUT_S) as background:
            yield Served(f"http://127.0.0.1:{background.port}", pool, engine,
                         config.gateway.api_keys[0] if config.gateway.api_keys else None, background)
    finally:
        pool.close()


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
        return served.pool.show(session_id, kind="session")["steps"]
    except KeyError:  # the rollout never called the model: no session, nothing to judge
        return []
