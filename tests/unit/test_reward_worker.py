"""The reward worker's plumbing with a scripted judge: which turns it picks, what it stores."""

from __future__ import annotations

import asyncio
import json

from clawr1.core.config import load_config
from clawr1.core.records import Reward, Step
from clawr1.datapool import SQLitePool
from clawr1.reward.types import Judgement
from clawr1.reward.worker import RewardWorker
from tests.conftest import run


class ScriptedJudge:
    """+1 for thanks, -1 with a hint for "no, ...", 0 otherwise; remembers what it was asked."""

    name = "scripted"

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    async def judge(self, context, reply, next_state, m, want_hint):
        text = next_state[-1]["content"]
        self.seen.append((context[-1]["content"], text))
        if text.startswith("Thanks"):
            return Judgement(1, [1] * m, ["Score: +1"] * m, "judge majority", "judge", None, "no_correction")
        if text.startswith("No"):
            return Judgement(-1, [-1] * m, ["Score: -1"] * m, "judge majority", "judge",
                             "Answer with a single number." if want_hint else None,
                             None if want_hint else "not_requested")
        return Judgement(0, [0] * m, ["Score: 0"] * m, "ambiguous", "judge", "Be brief about it please." if
                         want_hint else None, None if want_hint else "not_requested")


def step(i: int, session: str, turn: int, messages: list[dict]) -> Step:
    return Step(step_id=f"{session}-{turn}", tenant="default", session_id=session, prompt_id=session, turn_index=turn,
                turn_type="main", messages=messages, tools=None, prompt_ids=[1, 2], token_ids=[3, 4],
                logprobs=[-0.1, -0.2], text=f"reply {i}", policy_version=0, adapter=None, finish_reason="stop",
                temperature=1.0)


def conversation(pool: SQLitePool, session: str, follow_up: str) -> None:
    first = [{"role": "user", "content": f"question of {session}"}]
    pool.append_step(step(0, session, 0, first))
    pool.append_step(step(1, session, 1, first + [{"role": "assistant", "content": "reply 0"},
                                                  {"role": "user", "content": follow_up}]))


async def _drive(worker: RewardWorker, pool: SQLitePool, judged: int) -> None:
    task = asyncio.create_task(worker.run())
    try:
        for _ in range(200):
            if sum(v for k, v in worker.counts.items() if k.startswith("score_")) >= judged:
                break
            await asyncio.sleep(0.02)
    finally:
        task.cancel()


def test_worker_judges_turns_with_a_next_state_and_keeps_the_evidence(tmp_path):
    config = load_config(None, [f'data_dir="{tmp_path}"', 'trainer.method="combine"', "reward.poll_s=0.01"])
    with SQLitePool(tmp_path, config.pool) as pool:
        conversation(pool, "good", "Thanks, perfect!")
        conversation(pool, "bad", "No, I asked for a number.")
        conversation(pool, "meh", "Hmm.")
        conversation(pool, "felt", "No, wrong.")
        pool.add_reward(Reward(step_id="felt-0", score=1.0, source="feedback"))  # explicit: never judged
        judge = ScriptedJudge()
        worker = RewardWorker(pool, None, config, judge=judge)
        run(_drive(worker, pool, 3))
        assert sorted(judge.seen) == sorted([("question of good", "Thanks, perfect!"),
                                             ("question of bad", "No, I asked for a number."),
                                             ("question of meh", "Hmm.")])  # only turns with a next state
        good, bad, meh = (pool.show(f"{s}-0") for s in ("good", "bad", "meh"))
        assert good["sample"]["reward"] == 1 and good["sample"]["status"] == "ready"
        assert bad["sample"]["reward"] == -1 and [h["text"] for h in bad["hints"]] == ["Answer with a single number."]
        assert bad["rewards"][0]["votes"] == [-1, -1, -1]  # m = 3 for combine
        assert json.loads(bad["rewards"][0]["evidence"])["raw"] == ["Score: -1"] * 3
        assert meh["sample"]["reward"] == 0 and meh["sample"]["status"] == "ready"  # 0 but a hint: OPD material
        assert pool.show("felt-0")["sample"]["reward"] == 1.0
        assert pool.show("good-1")["sample"]["reward"] is None  # the last turns wait for their next state


def test_rl_masks_zero_scores_and_asks_no_hints(tmp_path):
    config = load_config(None, [f'data_dir="{tmp_path}"', 'trainer.method="rl"', "reward.poll_s=0.01"])
    with SQLitePool(tmp_path, config.pool) as pool:
        conversation(pool, "meh", "Hmm.")
        worker = RewardWorker(pool, None, config, judge=ScriptedJudge())
        run(_drive(worker, pool, 1))
        meh = pool.show("meh-0")
        assert meh["sample"]["reward"] == 0 and meh["sample"]["status"] == "pending" and meh["hints"] == []


class FlakyJudge(ScriptedJudge):
    """The scripted judge, except that it crashes on every turn whose next state says "Boom"."""

    async def judge(self, context, reply, next_state, m, want_hint):
        if next_state[-1]["content"].startswith("Boom"):
            self.seen.append((context[-1]["content"], next_state[-1]["content"]))
            raise RuntimeError("the judge choked on this turn")
        return await super().judge(context, reply, next_state, m, want_hint)


async def _drive_until(worker: RewardWorker, done, rounds: int = 300) -> None:
    task = asyncio.create_task(worker.run())
    try:
        for _ in range(rounds):
            if done():
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # a few more polls: nothing given up on may come back
    finally:
        task.cancel()


def test_a_turn_whose_judging_always_fails_is_given_up_with_its_reason_and_the_rest_is_judged(tmp_path, capsys):
    from clawr1.cli.main import main

    config = load_config(None, [f'data_dir="{tmp_path}"', 'trainer.method="rl"', "reward.poll_s=0.01",
                                "reward.max_judge_attempts=3", "reward.judge_retry_s=0.01"])
    with SQLitePool(tmp_path, config.pool) as pool:
        conversation(pool, "poison", "Boom, an input the judge cannot take.")
        conversation(pool, "good", "Thanks, perfect!")
        conversation(pool, "other", "Thanks, again!")
        judge = FlakyJudge()
        worker = RewardWorker(pool, None, config, judge=judge)
        run(_drive_until(worker, lambda: worker.counts["judge_gave_up"] and worker.counts["score_+1"] == 2))
        assert [seen for seen in judge.seen if seen[0] == "question of poison"] == [
            ("question of poison", "Boom, an input the judge cannot take.")] * 3  # 3 attempts, then never again
        sample = pool.show("poison-0")["sample"]
        assert sample["judge_attempts"] == 3 and sample["judge_gave_up_at"] is not None
        assert sample["judge_error"] == "RuntimeError: the judge choked on this turn"
        assert sample["status"] == "pending" and sample["reward"] is None  # feedback could still reward it
        assert [pool.show(f"{s}-0")["sample"]["reward"] for s in ("good", "other")] == [1.0, 1.0]
        assert worker.counts["judge_errors"] == 3 and worker.counts["judge_gave_up"] == 1
        assert pool.unjudged() == []
        turn = pool.show("poison")["steps"][0]  # the session view (the dashboard's) carries it too
        assert (turn["judge_attempts"], turn["judge_error"]) == (3, sample["judge_error"])
    assert main(["pool", "show", "poison-0", "--data-dir", str(tmp_path)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["sample"]["judge_error"] == "RuntimeError: the judge choked on this turn"
    assert shown["sample"]["judge_gave_up_at"] is not None


def test_a_dead_shard_does_not_starve_a_live_one(tmp_path):
    from clawr1.datapool.schema import shard_key

    config = load_config(None, [f'data_dir="{tmp_path}"', 'trainer.method="rl"', "reward.poll_s=0.01",
                                "reward.concurrency=1"])
    sessions = [f"s{i}" for i in range(40)]
    dead = [s for s in sessions if shard_key(f"{s}-0") % 2 == 1][:6]  # the oldest waiting turns: shard 1's
    live = [s for s in sessions if shard_key(f"{s}-0") % 2 == 0][:2]
    with SQLitePool(tmp_path, config.pool) as pool:
        for session in dead + live:
            conversation(pool, session, "Thanks, perfect!")
        judge = ScriptedJudge()
        worker = RewardWorker(pool, None, config, judge=judge, shard=(0, 2))  # shard 1's worker is dead
        run(_drive(worker, pool, len(live)))
        assert sorted(context for context, _ in judge.seen) == sorted(f"question of {s}" for s in live)
        assert all(pool.show(f"{s}-0")["sample"]["reward"] == 1.0 for s in live)
        assert sorted(pool.unjudged(shard=(1, 2))) == sorted(f"{s}-0" for s in dead)  # still waiting for theirs
