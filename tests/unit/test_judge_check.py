"""The judge's accuracy against the simulated users' own labels (`clawr1.demo.judge_check`)."""

from __future__ import annotations

from clawr1.core.records import Reward, Step
from clawr1.datapool import SQLitePool
from clawr1.demo.judge_check import confusion, summary, user_label
from tests.gateway_helpers import wait_for


def turn(session: str, index: int, user: str) -> Step:
    messages = [{"role": "system", "content": "You are Anna's personal assistant."}, {"role": "user", "content": user}]
    return Step(step_id=f"{session}-{index}", tenant="default", session_id=session, prompt_id=f"{session}/t{index}",
                turn_index=index, turn_type="main", messages=messages, tools=None, prompt_ids=[1, 2], token_ids=[3],
                logprobs=[-0.1], text="reply", policy_version=0, adapter=None, finish_reason="stop", temperature=0.7)


def test_labels_come_from_what_the_user_said():
    assert user_label([{"role": "user", "content": "Great, thank you. Next one: How do I fix a bike chain?"}]) == 1
    assert user_label([{"role": "user", "content": "That's way too long. Please answer in one short paragraph."}]) == -1
    assert user_label([{"role": "tool", "content": "ok"}]) is None


def test_the_judges_verdicts_are_scored_against_the_users_labels(tmp_path):
    with SQLitePool(tmp_path) as pool:
        said = ["How do I boil an egg?", "Thanks, that's helpful! Also, how do I peel it?",  # turn 0 -> thanks
                "Please don't use bold text, I read this in plain text.",  # turn 1 -> a correction
                "Perfect, thanks. One more thing: what about tea?"]  # turn 2 -> thanks
        for i, text in enumerate(said):
            pool.append_step(turn("s", i, text))
        for i, (score, source) in enumerate(((1.0, "classifier"), (-1.0, "classifier"), (-1.0, "judge"))):
            pool.add_reward(Reward(step_id=f"s-{i}", score=score, source=source))  # the LLM judge got turn 2 wrong
        pool.add_reward(Reward(step_id="s-1", score=1.0, source="feedback"))  # not a judge: ignored
        pool.append_step(turn("t", 0, "How do I boil an egg?"))
        pool.append_step(turn("t", 1, "Great, thank you."))
        pool.add_reward(Reward(step_id="t-0", score=-1.0, source="rule"))  # a rule's verdict: not the judge's
        wait_for(lambda: pool.stats()["rewards"] == 5, what="the rewards")
        counts = confusion(pool)
    assert counts == {(1, 1.0): 1, (-1, -1.0): 1, (1, -1.0): 1}
    result = summary(counts)
    assert abs(result["accuracy"] - 2 / 3) < 1e-9 and result["recall_corrections"] == 1.0
    assert result["recall_thanks"] == 0.5
