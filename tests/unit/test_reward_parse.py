"""Judge prompts and the parsing of votes and hints: exact, and robust to what small models write."""

from __future__ import annotations

import pytest

from clawr1.reward.parse import describe_majority, majority, parse_hint, parse_vote, select_hint, vote_of
from clawr1.reward.prompts import HINT_END, HINT_START, hint_messages, judge_messages

CONTEXT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Old question"},
           {"role": "assistant", "content": "Old answer"}, {"role": "user", "content": "Load data.csv"}]
NEXT = [{"role": "tool", "name": "bash", "content": "ok"}, {"role": "user", "content": "No, use pandas."}]


def test_judge_prompt_is_exact():
    messages = judge_messages(CONTEXT, "import csv", NEXT)
    assert messages == [
        {"role": "system", "content": "You grade an AI assistant's reply by what came next."},
        {"role": "user", "content": (
            "Request: Load data.csv\nReply: import csv\nNext:\ntool (bash): ok\nuser: No, use pandas.\n\n"
            "Did the reply succeed? +1 = the user thanks, accepts or moves on, or the tool worked. "
            "-1 = the user corrects, complains, retries or rephrases, or the tool failed. 0 = unclear.\n"
            "Answer: Score: +1, Score: -1 or Score: 0.")},
        {"role": "assistant", "content": "Score:"},
    ]


def test_hint_prompt_asks_for_markers_and_ends_with_the_start_marker():
    messages = hint_messages(CONTEXT, "import csv", NEXT)
    assert messages[1]["content"].startswith("Request: Load data.csv\nReply: import csv\nNext:\n")
    assert f"between {HINT_START} and {HINT_END}" in messages[1]["content"]
    assert f"{HINT_START} NONE {HINT_END}" in messages[1]["content"]
    assert messages[-1] == {"role": "assistant", "content": HINT_START}


def test_long_fields_are_clipped_keeping_both_ends():
    tool = {"role": "tool", "content": "start\n" + "x" * 5000 + "\nZeroDivisionError: division by zero"}
    content = judge_messages([{"role": "user", "content": "q" * 2000}], "r" * 2000, [tool])[1]["content"]
    assert len(content) < 1600
    assert "ZeroDivisionError: division by zero" in content and "start" in content and "[...]" in content


def test_no_user_message_and_empty_reply_are_named():
    content = judge_messages([], "", [{"role": "user", "content": "thanks"}])[1]["content"]
    assert content.startswith("Request: (none)\nReply: (empty)\nNext:\nuser: thanks")


@pytest.mark.parametrize("text, vote", [
    ("Score: +1", 1), ("Score: -1", -1), ("Score: 0", 0), ("Score: 1", 1), ("score=-1", -1), ("SCORE : +1", 1),
    ("Score: 1.0", 1), ("Score: +1.\n\nThe user thanked", 1), ("The user corrected it.\n**Score:** -1", -1),
    ("Reasoning first.\nScore: -1\nNote: options were +1 or -1", -1), ("\\boxed{-1}", -1), ("+1", 1), (" -1\n", -1),
])
def test_votes_parse(text, vote):
    assert parse_vote(text) == vote


@pytest.mark.parametrize("text", [
    "", "Score:", "Score: The user wants", "Score: 15", "Score: 0.5", "Score: 1 or", "Score: +1 or Score: -1",
    "Score: +1/-1", "Score: +1, Score: -1", " -1 or", "I think it went well.", "Score: +3",
])
def test_unparsable_votes_are_none_and_count_as_zero(text):
    assert parse_vote(text) is None
    assert vote_of(text) == 0


@pytest.mark.parametrize("votes, winner", [
    ([1, 1, 0], (1, 2)), ([-1, -1, 1], (-1, 2)), ([1, -1, 0], (0, 1)), ([1, -1], (0, 1)), ([0, 0, 1], (0, 2)),
    ([-1], (-1, 1)), ([], (0, 0)), ([1, 1, -1, -1, 0], (0, 2)),
])
def test_majority_ties_give_zero(votes, winner):
    assert majority(votes) == winner


def test_majority_is_described():
    assert describe_majority([1, 1, 0], 1) == "judge majority 2/3 (+1), 1 unparsable"
    assert describe_majority([1, -1, 0], 0) == "judge tie (+1, -1, 0) -> 0"
    assert describe_majority([-1, -1, -1], 0) == "judge majority 3/3 (-1)"


@pytest.mark.parametrize("text, parsed", [
    ("[HINT_START] Use pandas instead of csv. [HINT_END]", ("Use pandas instead of csv.", None)),
    ("[HINT_START]Use pandas.\nGroup by region.[HINT_END] trailing", ("Use pandas. Group by region.", None)),
    ("[hint start] lower case markers [/HINT_END]", ("lower case markers", None)),
    ("[HINT_START] Use pandas. Also group by", ("Use pandas.", None)),  # cut by max_tokens: last full sentence
    ("[HINT_START] Use pandas.\n[HINT_START] Use pandas again. [HINT_END]", ("Use pandas.", None)),  # a loop
    ("[HINT_START] NONE [HINT_END]", (None, "no_correction")),
    ("[HINT_START] none. [HINT_END]", (None, "no_correction")),
    ("No correction here.", (None, "no_correction")),
    ("[HINT_START][HINT_END]", (None, "unparsable")),
    ("[HINT_START]", (None, "unparsable")),
    ("The user seems happy.", (None, "unparsable")),
])
def test_hints_parse(text, parsed):
    assert parse_hint(text) == parsed


def test_the_longest_hint_long_enough_is_accepted():
    raw = ["[HINT_START] Use pandas. [HINT_END]", "[HINT_START] Use pandas and group by region. [HINT_END]",
           "[HINT_START] NONE [HINT_END]"]
    result = select_hint(raw, min_chars=10)
    assert result.hint == "Use pandas and group by region." and result.reason is None and result.raw == raw


def test_a_too_short_hint_is_rejected_with_its_reason():
    result = select_hint(["[HINT_START] Use pandas. [HINT_END]", "[HINT_START] NONE [HINT_END]"], min_chars=20)
    assert result.hint is None and result.reason == "too_short"


def test_no_correction_beats_unparsable_and_unparsable_is_the_last_resort():
    assert select_hint(["[HINT_START] NONE [HINT_END]", "gibberish"], 20).reason == "no_correction"
    assert select_hint(["gibberish", "more gibberish"], 20).reason == "unparsable"


def test_a_hint_that_says_there_is_nothing_to_correct_is_none():
    """Between the markers too: "No correction needed" is not a correction (it once trained as
    one, beating the other votes' NONE by length); a correction that starts with "No" still is."""
    for none in ("No correction needed, the user was satisfied.", "There is no concrete correction here.",
                 "No hint: the reply was fine.", "Nothing to correct."):
        assert parse_hint(f"{HINT_START} {none} {HINT_END}") == (None, "no_correction"), none
    for hint in ("No bold text, please use plain sentences.", "Nobody asked for a list: answer in one line."):
        assert parse_hint(f"{HINT_START} {hint} {HINT_END}") == (hint, None), hint


def test_a_vote_on_the_line_after_score_counts():
    """The embedded judge continues the prompt's "Score:"; it may start with a newline."""
    assert parse_vote("Score:\n-1") == -1 and parse_vote("Score: \n\n+1") == 1 and parse_vote("Score:\n0") == 0
    assert parse_vote("Score:\n+1 or -1") is None  # the options, not a choice
