"""Step-wise rewards: an intermediate turn's judge score mixed with its session's outcome,
(1 - w) * judge + w * outcome, whatever order the judge and the close arrive in."""

from __future__ import annotations

import json

import httpx
import pytest

from clawr1.core.records import Reward, Step
from clawr1.datapool import DataPool
from tests.gateway_helpers import live_gateway, steps_of, wait_for

W = 0.25
JUDGE = {0: 1.0, 1: -1.0}  # turns 0 and 1 are intermediate; turn 2 is the last
MIXED = {0: 1.0, 1: 0.75 * -1.0 + 0.25 * 1.0}  # with outcome +1


def step(session: str, turn: int) -> Step:
    return Step(step_id=f"{session}-{turn}", tenant="default", session_id=session, prompt_id=session,
                turn_index=turn, turn_type="main", messages=[{"role": "user", "content": f"turn {turn}"}],
                tools=None, prompt_ids=[1, 2], token_ids=[3], logprobs=[-0.5], text="reply", policy_version=0,
                adapter=None, finish_reason="stop", temperature=1.0)


def three_turns(pool: DataPool, session: str) -> None:
    pool.append_steps([step(session, t) for t in range(3)])


def judge(pool: DataPool, session: str) -> None:
    for turn, score in JUDGE.items():
        pool.add_reward(Reward(step_id=f"{session}-{turn}", score=score, source="judge", votes=[score]))


def rewards(pool: DataPool, session: str) -> dict[int, float]:
    return {s["turn_index"]: s["reward"] for s in pool.show(session)["steps"]}


def test_judge_then_close_mixes_the_outcome_into_intermediate_turns(open_test_pool):
    with open_test_pool() as pool:
        three_turns(pool, "a")
        judge(pool, "a")
        assert rewards(pool, "a") == {0: 1.0, 1: -1.0, 2: None}
        pool.close_session("a", 1.0, step_weight=W)
        assert rewards(pool, "a") == {**MIXED, 2: 1.0}  # the last turn gets the outcome itself
        detail = pool.show("a-1")
        assert [r["source"] for r in detail["rewards"]] == ["judge", "stepwise"]
        parts = json.loads(detail["rewards"][-1]["evidence"])  # `clawr1 pool show` explains the number
        assert (parts["judge"], parts["outcome"], parts["step_weight"]) == (-1.0, 1.0, W)
        assert detail["sample"]["status"] == "ready"


def test_close_then_judge_gives_the_same_rewards(open_test_pool):
    with open_test_pool() as pool:
        three_turns(pool, "b")
        pool.close_session("b", 1.0, step_weight=W)
        assert rewards(pool, "b") == {0: None, 1: None, 2: 1.0}
        judge(pool, "b")  # the reward worker judges after the close
        assert rewards(pool, "b") == {**MIXED, 2: 1.0}
        assert json.loads(pool.show("b-0")["rewards"][-1]["evidence"])["judge_source"] == "judge"


def test_explicit_feedback_still_wins_before_or_after_the_close(open_test_pool):
    with open_test_pool() as pool:
        three_turns(pool, "c")
        judge(pool, "c")
        pool.add_feedback(session_id="c", turn_index=1, score=0.5)
        pool.close_session("c", 1.0, step_weight=W)
        assert rewards(pool, "c") == {0: MIXED[0], 1: 0.5, 2: 1.0}
        pool.add_feedback(session_id="c", turn_index=0, score=-0.5)  # after the mix: feedback still wins
        assert rewards(pool, "c")[0] == -0.5

        three_turns(pool, "d")
        pool.add_feedback(session_id="d", turn_index=1, score=0.5)
        pool.close_session("d", 1.0, step_weight=W)
        judge(pool, "d")  # a late judge neither overrides the feedback nor mixes into it
        assert rewards(pool, "d") == {0: MIXED[0], 1: 0.5, 2: 1.0}


def test_zero_weight_or_no_outcome_is_todays_behaviour(open_test_pool):
    with open_test_pool() as pool:
        three_turns(pool, "e")
        judge(pool, "e")
        pool.close_session("e", 1.0)
        three_turns(pool, "f")
        pool.close_session("f", None, step_weight=W)
        judge(pool, "f")
        assert rewards(pool, "e") == {0: 1.0, 1: -1.0, 2: 1.0}
        assert rewards(pool, "f") == {0: 1.0, 1: -1.0, 2: None}
        assert pool.stats()["rewards"] == 2 + 1 + 2  # nothing step-wise recorded
        with pytest.raises(ValueError):
            pool.close_session("e", 1.0, step_weight=1.5)


def test_close_route_takes_a_per_call_weight_and_defaults_to_the_config(engine, tmp_path):
    ask = {"model": "m", "max_tokens": 2, "temperature": 0}
    with live_gateway(engine, tmp_path, f"reward.step_weight={W}") as (base, pool):
        for session in ("g", "h"):
            for turn in range(3):
                httpx.post(f"{base}/{session}/grp/v1/chat/completions", timeout=30,
                           json={**ask, "messages": [{"role": "user", "content": f"turn {turn}"}]}).raise_for_status()
        steps = steps_of(pool, 6)
        ids = {(s.session_id, s.turn_index): s.step_id for s in steps}
        assert {s.prompt_id for s in steps} == {"grp"}
        pool.add_reward(Reward(step_id=ids[("g", 0)], score=-1.0, source="judge"))
        pool.add_reward(Reward(step_id=ids[("h", 0)], score=-1.0, source="judge"))
        closed = httpx.post(f"{base}/v1/sessions/g/close", json={"outcome_reward": 1}).json()
        assert (closed["step_weight"], closed["turns"]) == (W, 3)
        httpx.post(f"{base}/v1/sessions/h/close", json={"outcome_reward": 1, "step_weight": 1}).raise_for_status()
        wait_for(lambda: pool.show("h")["status"] == "closed", what="h closed")
        assert pool.show(ids[("g", 0)])["sample"]["reward"] == pytest.approx(0.75 * -1 + 0.25 * 1)
        assert pool.show(ids[("h", 0)])["sample"]["reward"] == 1.0  # w = 1: the outcome alone
        bad = httpx.post(f"{base}/v1/sessions/g/close", json={"outcome_reward": 1, "step_weight": 2})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "step_weight"
