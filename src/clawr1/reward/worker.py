"""The reward worker: judges every main turn whose next state has arrived, beside serving.

It polls the pool for unrewarded turns with a linked next state, judges up to
`reward.concurrency` at once (their votes batch in the engine with serving traffic, never in a
request's path), and stores each result as a reward (votes, raw outputs and evidence kept) and,
for OPD methods, a hint. A 0 score stays PENDING (masked, never trained) unless a hint makes the
sample useful for distillation.

A turn whose judging fails (the judge server is down, a rule crashes on it) is recorded as a failed
attempt and tried again after a backoff; after `reward.max_judge_attempts` the pool gives up on it,
with the last error as the reason, so one poisoned turn is not retried forever. With several
workers (Ray judge actors), each asks the pool for its own shard's turns only: a stuck shard never
fills another worker's page.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging

from clawr1.core.config import Config
from clawr1.core.records import Hint, Reward, Step
from clawr1.datapool.base import PoolQueue
from clawr1.engine.base import Engine
from clawr1.reward.factory import make_judge, votes_for
from clawr1.reward.types import Judge, Judgement

log = logging.getLogger(__name__)
MAX_ERROR_CHARS = 500  # of a failed attempt's error kept on the sample: enough to see why, small rows


class RewardWorker:
    def __init__(self, pool: PoolQueue, engine: Engine | None, config: Config, judge: Judge | None = None,
                 shard: tuple[int, int] = (0, 1)):
        """`shard = (i, n)`: with n workers on one pool (Ray judge actors), this one judges the
        turns of shard i (`PoolQueue.unjudged`), so no turn is judged twice."""
        self.pool, self.config, self.engine = pool, config, engine
        self.shard = shard
        self.judge = judge  # built in `run`, off the event loop: serving starts without waiting for it
        self.m = votes_for(config)
        self.want_hint = config.trainer.method != "rl"
        self.counts: collections.Counter[str] = collections.Counter()  # outcomes, hint reasons
        self.outcomes: collections.Counter[tuple[int, str]] = collections.Counter()  # (score, source): /metrics

    async def run(self) -> None:
        """Judge forever (cancel to stop)."""
        if self.judge is None:
            self.judge = await asyncio.to_thread(make_judge, self.config, self.engine)
            log.info("reward worker judging with %s", self.judge.name)
        limit = self.config.reward.concurrency
        running: dict[str, asyncio.Task] = {}
        while True:
            if len(running) < limit:
                waiting = await asyncio.to_thread(self.pool.unjudged, limit * 2, self.shard)
                fresh = [s for s in waiting if s not in running][: limit - len(running)]
                if fresh:
                    for step in await asyncio.to_thread(self.pool.get_steps, fresh):
                        running[step.step_id] = asyncio.create_task(self.judge_step(step))
            if not running:
                await asyncio.sleep(self.config.reward.poll_s)
                continue
            done, _ = await asyncio.wait(running.values(), timeout=self.config.reward.poll_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            for step_id in [s for s, task in running.items() if task in done]:
                task = running.pop(step_id)
                if task.exception() is not None:  # a judge outage must not stop serving: count, log, retry
                    self.counts["judge_errors"] += 1
                    log.error("judging %s failed: %r", step_id, task.exception())

    async def judge_step(self, step: Step) -> Judgement:
        """Judge one turn and store the result; a failure is recorded on the turn, then re-raised."""
        assert self.judge is not None, "run() builds the judge"
        try:
            judgement = await self.judge.judge(step.messages, step.text, step.next_state or [], self.m, self.want_hint)
            await self.store(step.step_id, judgement)
        except Exception as error:
            await self.failed(step.step_id, error)
            raise
        return judgement

    async def failed(self, step_id: str, error: Exception) -> None:
        """Record a failed attempt; the pool retries the turn after a backoff, or gives up on it
        after `reward.max_judge_attempts`, keeping this error as the reason."""
        rc = self.config.reward
        reason = f"{type(error).__name__}: {error}"[:MAX_ERROR_CHARS]
        gave_up = await asyncio.to_thread(self.pool.judge_failed, step_id, reason, rc.max_judge_attempts,
                                          rc.judge_retry_s)
        if gave_up:
            self.counts["judge_gave_up"] += 1
            log.error("gave up judging %s after %d attempts; last error: %s", step_id, rc.max_judge_attempts, reason)

    async def store(self, step_id: str, j: Judgement) -> None:
        evidence = json.dumps({"evidence": j.evidence, "raw": j.raw, "hint_raw": j.hint_raw,
                               "hint_reason": j.hint_reason}, ensure_ascii=False)
        reward = Reward(step_id=step_id, score=float(j.score), source=j.source, votes=[float(v) for v in j.votes],
                        evidence=evidence)
        hint = Hint(step_id=step_id, text=j.hint, source=j.source) if j.hint else None
        # One write: a stop between a reward and its hint would lose the hint for good. The pool makes
        # the hint a memory entry of the turn's user in the same transaction (`datapool/ops.remember`).
        await asyncio.wrap_future(self.pool.submit_judgement(reward, hint))
        self.counts[f"score_{j.score:+d}"] += 1
        self.outcomes[j.score, j.source] += 1
        if j.hint:
            self.counts["hints"] += 1
        elif self.want_hint:
            self.counts[f"no_hint_{j.hint_reason}"] += 1
