"""The reward worker: judges every main turn whose next state has arrived, beside serving.

It polls the pool for unrewarded turns with a linked next state, judges up to
`reward.concurrency` at once (their votes batch in the engine with serving traffic, never in a
request's path), and stores each result as a reward (votes, raw outputs and evidence kept) and,
for OPD methods, a hint. A 0 score stays PENDING (masked, never trained) unless a hint makes the
sample useful for distillation.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import zlib

from clawr1.core.config import Config
from clawr1.core.records import Hint, Reward, Step
from clawr1.datapool.base import DataPool
from clawr1.engine.base import Engine
from clawr1.reward.factory import make_judge, votes_for
from clawr1.reward.types import Judge, Judgement

log = logging.getLogger(__name__)


class RewardWorker:
    def __init__(self, pool: DataPool, engine: Engine | None, config: Config, judge: Judge | None = None,
                 shard: tuple[int, int] = (0, 1)):
        """`shard = (i, n)`: with n workers on one pool (Ray judge actors), this one judges the
        turns whose step id hashes to i, so no turn is judged twice."""
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
                waiting = await asyncio.to_thread(self.pool.unjudged, limit * 2)
                mine = [s for s in waiting if zlib.crc32(s.encode()) % self.shard[1] == self.shard[0]]
                fresh = [s for s in mine if s not in running][: limit - len(running)]
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
        assert self.judge is not None, "run() builds the judge"
        judgement = await self.judge.judge(step.messages, step.text, step.next_state or [], self.m, self.want_hint)
        await self.store(step.step_id, judgement)
        return judgement

    async def store(self, step_id: str, j: Judgement) -> None:
        evidence = json.dumps({"evidence": j.evidence, "raw": j.raw, "hint_raw": j.hint_raw,
                               "hint_reason": j.hint_reason}, ensure_ascii=False)
        await asyncio.wrap_future(self.pool.submit_reward(Reward(step_id=step_id, score=float(j.score),
                                                                 source=j.source, votes=[float(v) for v in j.votes],
                                                                 evidence=evidence)))
        self.counts[f"score_{j.score:+d}"] += 1
        self.outcomes[j.score, j.source] += 1
        if j.hint:
            await asyncio.to_thread(self.pool.add_hint, Hint(step_id=step_id, text=j.hint, source=j.source))
            self.counts["hints"] += 1
            if j.score == 0:  # no reward, but a hint: still a distillation sample
                await asyncio.to_thread(self.pool.mark_ready, step_id)
        elif self.want_hint:
            self.counts[f"no_hint_{j.hint_reason}"] += 1
