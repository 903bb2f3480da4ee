"""The LLM judge end to end on the real embedded SmolLM2-135M (base weights): the call path works
and every output is parsed. Not accuracy: at 135M the judge is near chance (see `clawr1 bench judge`)."""

from __future__ import annotations

import pytest

from clawr1.core.config import load_config
from clawr1.reward.factory import EMBEDDED_HINT_TOKENS, llm_judge, make_judge
from clawr1.reward.judge import LLMJudge
from clawr1.reward.parse import majority, parse_hint, vote_of
from clawr1.reward.prompts import HINT_START, VOTE_PREFIX
from tests.conftest import run

CONTEXT = [{"role": "user", "content": "Load sales.csv and show the average price per region."}]
REPLY = "import csv\nrows = list(csv.DictReader(open('sales.csv')))"
WRONG = [{"role": "user", "content": "No, that is wrong, use pandas. A groupby on region is all I need."}]


@pytest.fixture(scope="module")
def judge(real_engine) -> LLMJudge:
    return llm_judge(load_config(), real_engine)


def test_votes_and_hints_come_back_parsed(judge, real_engine):
    judgement = run(judge.judge(CONTEXT, REPLY, WRONG, 3, True))
    assert len(judgement.raw) == 3 and all(text.startswith(VOTE_PREFIX) for text in judgement.raw)
    assert judgement.votes == [vote_of(text) for text in judgement.raw]
    assert judgement.score == majority(judgement.votes)[0] and judgement.source == "judge"
    assert judgement.evidence.startswith(("judge majority", "judge tie"))
    assert len(judgement.hint_raw) == 3 and all(text.startswith(HINT_START) for text in judgement.hint_raw)
    # Each hint vote stays within its token budget (a few characters per token at most).
    assert all(len(text) < len(HINT_START) + 8 * EMBEDDED_HINT_TOKENS for text in judgement.hint_raw)
    if judgement.hint is None:
        assert judgement.hint_reason in ("no_correction", "too_short", "unparsable")
    else:
        assert len(judgement.hint) >= 20 and any(parse_hint(text)[0] == judgement.hint for text in judgement.hint_raw)
    assert real_engine.adapters() == {}  # judged on the base weights


def test_make_judge_puts_rules_first_and_uses_the_engine_for_the_rest(real_engine):
    judge = make_judge(load_config(None, ['reward.judge="llm"']), real_engine)
    traceback = {"role": "tool", "name": "python", "content": "Traceback (most recent call last):\nKeyError: 'price'"}
    by_rule = run(judge.judge(CONTEXT, REPLY, [traceback], 1, True))
    assert by_rule.source == "rule" and by_rule.score == -1 and len(by_rule.hint_raw) == 1
    by_model = run(judge.judge(CONTEXT, REPLY, [{"role": "user", "content": "Thanks!"}], 1, False))
    assert by_model.source == "judge" and len(by_model.votes) == 1 and by_model.hint_reason == "not_requested"
