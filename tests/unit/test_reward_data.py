"""The shipped turn sets: well formed, varied, and the training set shares no wording with the
evaluation set (so the classifier is not graded on what it learned from)."""

from __future__ import annotations

from collections import Counter

from clawr1.reward.dataset import CATEGORIES, load_items
from clawr1.reward.turn import message_text, task_of


def test_the_evaluation_set_is_large_varied_and_labelled():
    items = load_items("next_states")
    assert len(items) >= 60 and len({i.id for i in items}) == len(items)
    assert set(Counter(i.category for i in items)) == CATEGORIES
    assert all(Counter(i.label for i in items)[label] >= 5 for label in (-1, 0, 1))
    assert sum(i.correction for i in items) >= 20
    assert all(i.label == -1 for i in items if i.correction)  # a correction means the reply missed
    assert all(task_of(i.context) for i in items)
    assert all(m["role"] in ("user", "tool") for i in items for m in i.next_state)


def test_training_and_evaluation_sets_are_disjoint():
    train, evaluation = load_items("train"), load_items("next_states")
    assert set(Counter(i.category for i in train)) == CATEGORIES
    def texts(items):
        return {message_text(m).strip().lower() for i in items for m in i.next_state if message_text(m).strip()}
    def tasks(items):
        return {task_of(i.context).strip().lower() for i in items}
    assert not {i.id for i in train} & {i.id for i in evaluation}
    assert not texts(train) & texts(evaluation)
    assert not tasks(train) & tasks(evaluation)


def test_both_sets_hold_complaints_about_replies_that_do_not_answer():
    """Short nonsense, echoed prompts and off-topic replies, each met with a complaint: -1."""
    for name, prefix in (("train", "tr-na-"), ("next_states", "na-")):
        complaints = [i for i in load_items(name) if i.id.startswith(prefix)]
        assert len(complaints) >= 8 and all(i.label == -1 and i.category == "retry" for i in complaints)
        assert any(len(i.reply.split()) < 5 for i in complaints)  # "You're right."
        assert any("personal assistant" in i.reply for i in complaints)  # the system prompt, echoed
