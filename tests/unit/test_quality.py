"""Reply quality: exact maths on the tiny model and the real MiniLM embedder, calibration edges,
sanity decisions and the guard's paired verdict."""

import asyncio
import json

import pytest

from clawr1.core.config import EngineConfig
from clawr1.core.types import SamplingParams
from clawr1.engine.local import LocalEngine
from clawr1.quality import (
    Calibration,
    Quality,
    QualityMeter,
    Reply,
    Summary,
    calibrate,
    insane_because,
    not_worse,
    quantile,
    repetition,
    request_text,
    sane,
    summarize,
)
from clawr1.quality.meter import SAME_TOPIC
from clawr1.reward.embed import Embedder
from tests.conftest import run
from tests.unit.test_adapters import make_adapter


@pytest.fixture(scope="module")
def embedder():
    return Embedder.load()


@pytest.fixture
def drift_engine(tiny_model_dir, tmp_path):
    """A fresh tiny engine with a random LoRA adapter `policy` loaded: a version that has drifted."""
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, max_batch=8))
    run(engine.load_adapter("policy", make_adapter(tiny_model_dir, tmp_path, 1, seed=0)))
    yield engine
    run(engine.close())


def q(relevance=0.6, fluency=-1.5, rep=0.0, empty=False, kl=None, entropy=None, tool_call=False):
    return Quality(relevance, fluency, rep, empty, 10, kl, entropy, tool_call=tool_call)


def mean(xs):
    return sum(xs) / len(xs)


def test_repetition_of_known_strings():
    assert repetition("the the the the the") == pytest.approx(2 / 3)  # three 3-grams, one distinct
    assert repetition("The cat sat. the CAT sat!") == pytest.approx(1 / 4)  # case and punctuation dropped
    assert repetition(" ".join(["the"] * 42)) == pytest.approx(1 - 1 / 40)
    assert repetition("Boil water, add the tea, wait three minutes.") == 0.0
    assert repetition("Two words") == repetition("") == 0.0  # too short to repeat a 3-gram


def test_request_text_is_the_last_user_message_then_the_one_before():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "zeroth"},
                {"role": "user", "content": "How do I boil an egg?"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [{"type": "text", "text": "Shorter, "},
                                             {"type": "text", "text": "please."}]},
                {"role": "tool", "content": "42"}]
    assert request_text(messages) == "Shorter, please.\nHow do I boil an egg?"  # the topic is often one turn back
    assert request_text(messages[:3]) == "How do I boil an egg?\nzeroth"
    assert request_text(messages[:2]) == "zeroth"
    with pytest.raises(ValueError):
        request_text([{"role": "system", "content": "no user here"}])


def test_fluency_and_drift_are_exact_means_of_engine_scores(drift_engine, embedder):
    """Fluency = mean base logprob under the base's own distribution (T=1, uncut), whatever the reply
    was sampled at; KL = mean(behaviour - base at the sampling T); entropy = -mean(behaviour)."""
    engine = drift_engine
    messages = [[{"role": "user", "content": f"Tell me about topic {i}."}] for i in range(4)]

    async def go():
        prompts = [engine.render(m) for m in messages]
        gens = await asyncio.gather(*[engine.generate(p, SamplingParams(max_tokens=16, temperature=0.8, seed=i),
                                                      adapter="policy").final() for i, p in enumerate(prompts)])
        replies = [Reply.from_generation(m, g) for m, g in zip(messages, gens)]
        measured = await QualityMeter(engine, embedder).measure(replies)
        base_t = [await engine.score(g.prompt_ids, g.token_ids, adapter=None, temperature=0.8) for g in gens]
        base_1 = [await engine.score(g.prompt_ids, g.token_ids, adapter=None) for g in gens]
        return gens, measured, base_t, base_1

    gens, measured, base_t, base_1 = run(go())
    for gen, m, bt, b1 in zip(gens, measured, base_t, base_1):
        assert gen.temperature == 0.8 and m.n_tokens == len(gen.token_ids) > 0
        assert m.fluency == pytest.approx(mean(b1), abs=1e-6) and abs(mean(b1) - mean(bt)) > 1e-3
        assert m.kl == pytest.approx(mean([v - b for v, b in zip(gen.logprobs, bt)]), abs=1e-6)
        assert m.entropy == pytest.approx(-mean(gen.logprobs), abs=1e-6)
    assert mean([m.kl for m in measured]) > 0.05  # a random adapter drifts: KL is positive on its own samples


def test_base_replies_have_no_drift_and_relevance_is_the_embedding_cosine(engine, embedder, generations):
    replies = [Reply.from_generation(m, g) for m, g in generations]
    measured = run(QualityMeter(engine, embedder).measure(replies))
    for reply, m in zip(replies, measured):
        assert abs(m.kl) < 1e-4  # sampled from the base itself: KL(base || base) = 0
        assert m.entropy == pytest.approx(-mean(reply.logprobs))
        if not reply.empty:
            request, text = embedder([request_text(reply.messages), reply.text])
            assert m.relevance == pytest.approx(float(request @ text), abs=1e-5)
    # Without behaviour logprobs there is no drift to report.
    plain = Reply.from_generation(*generations[0], drift=False)
    assert run(QualityMeter(engine, embedder).measure([plain]))[0].kl is None


def test_empty_and_whitespace_replies_are_never_sane(engine, embedder):
    messages = [{"role": "user", "content": "How can I sleep better?"}]
    prompt = engine.render(messages)
    blank = Reply(messages, " \n ", engine.tokenizer.encode(" \n ", add_special_tokens=False), prompt)
    nothing = Reply(messages, "", [], prompt)
    measured = run(QualityMeter(engine, embedder).measure([blank, nothing]))
    assert [m.empty for m in measured] == [True, True] and [m.relevance for m in measured] == [0.0, 0.0]
    assert measured[0].fluency is not None and measured[1].fluency is None  # nothing to score
    generous = Calibration(-1.0, -100.0, 1.0, 16, 0.5, -1.0, 0.0)
    assert not sane(measured[0], generous) and insane_because(measured[1], generous) == ["empty"]


def test_a_reply_that_asks_the_question_back_is_never_sane(engine, embedder):
    """The echo: relevance 1.0, fluent to the base, nothing repeated, so every other measure passes
    it (a guard review measured the base-calibrated range: sane 1.00 for echoes). An answer that
    names the question's words, and a short answer, are not echoes."""
    from clawr1.quality.measures import echoes

    question = "How do I pick a good avocado?"
    messages = [{"role": "user", "content": question}]
    prompt = engine.render(messages)

    def reply(text: str) -> Reply:
        return Reply(messages, text, engine.tokenizer.encode(text, add_special_tokens=False), prompt)

    echo, answer, short = reply(question), reply("To pick a good avocado, press it gently: ripe ones give a little."), reply("Yes.")
    measured = run(QualityMeter(engine, embedder).measure([echo, answer, short]))
    assert [m.echo for m in measured] == [True, False, False]
    assert measured[0].relevance > 0.99
    generous = Calibration(-1.0, -100.0, 1.0, 16, 0.5, -1.0, 0.0)
    assert insane_because(measured[0], generous) == ["echoes the request"] and sane(measured[1], generous)
    assert echoes("how do I PICK a good avocado", question) and not echoes("pick an avocado", "pick")
    assert not echoes("A nice way to spend a Sunday afternoon, what am I supposed to tell you?",
                      "What's a nice way to spend a Sunday afternoon?")


def test_a_restated_question_or_a_bare_refusal_is_never_sane(engine, embedder):
    """The base model's own likely wordings of a non-answer (a review, 2026-12-06) passed every
    measure on all 12 everyday probes: the question restated in a frame ("There are many ways to
    ...", "So you want to know how to ...?") adds no content word, and a refusal adds a few. A
    hedge before a real answer, a short factual answer and a real answer are none of these."""
    from clawr1.quality.measures import echoes, refuses

    basil = "How do I keep basil fresh?"
    assert echoes("So you want to know how to keep basil fresh?", basil)
    assert echoes("There are many ways to keep your basil fresh.", basil)
    assert refuses("There are many ways to keep basil fresh, but I'm afraid I'm unable to provide that.", basil)
    assert refuses("I'm sorry, but I can't help with your workout routine.", "Can you suggest a workout routine?")
    answers = [("Put the stems in a glass of water on the counter, like cut flowers, and cover the leaves loosely.", basil),
               (("I can't say for sure, but generally water succulents every two weeks, letting the soil dry out "
                 "between waterings, and use a pot with drainage holes."), "How often should I water succulents?"),
               ("The capital of France is Paris.", "What is the capital of France?"),
               ("I'm sorry to hear that. Try a little white vinegar on a cloth to lift the stain.", "How do I clean a rug?")]
    for text, question in answers:
        assert not echoes(text, question) and not refuses(text, question), text
    messages = [{"role": "user", "content": basil}]
    refusal = "I'm sorry, but I can't help with keeping basil fresh."
    [measured] = run(QualityMeter(engine, embedder).measure(
        [Reply(messages, refusal, engine.tokenizer.encode(refusal, add_special_tokens=False), engine.render(messages))]))
    generous = Calibration(-1.0, -100.0, 1.0, 16, 0.5, -1.0, 0.0)
    assert measured.refusal and insane_because(measured, generous) == ["refuses"]


def test_calibration_thresholds_from_a_given_set():
    base = [q(relevance=r / 10, fluency=-1 - r / 10, rep=0.01 * r) for r in range(11)] + [q(empty=True)]
    cal = calibrate(base)
    assert cal.n == 11  # the empty reply is left out
    # relevance 0.0..1.0: 10th percentile 0.1, median 0.5, margin 1.0 x (0.5 - 0.1) below it.
    assert cal.relevance_min == pytest.approx(0.1 - 0.4) and cal.relevance_median == pytest.approx(0.5)
    # fluency -1.0..-2.0: 10th percentile -1.9, median -1.5; the 0.5-nat floor is wider than the 0.4.
    assert cal.fluency_min == pytest.approx(-1.9 - 0.5) and cal.fluency_median == pytest.approx(-1.5)
    # repetition 0..0.10: 90th percentile 0.09 + (0.09 - 0.05) = 0.13, under the 0.25 floor.
    assert cal.repetition_max == 0.25
    assert calibrate(base, repetition_floor=0.0).repetition_max == pytest.approx(0.13)
    assert calibrate(base, margin=0.5).relevance_min == pytest.approx(0.1 - 0.2)
    # The chance edge lifts relevance's threshold when other requests' cosines reach higher...
    chance = [i / 250 for i in range(101)]  # 95th percentile 0.38, under the replies' median 0.5
    lifted = calibrate(base, chance)
    assert lifted.relevance_chance == pytest.approx(0.38) and lifted.relevance_min == pytest.approx(0.38)
    # ...but not when replies are as close to other requests as to their own (templated agent
    # tasks): an edge above the base's median relevance would call most of the base insane.
    level = calibrate(base, [i / 100 for i in range(101)])
    assert level.relevance_chance == pytest.approx(0.95) and level.relevance_min == pytest.approx(0.1 - 0.4)
    assert calibrate(base, [-0.5] * 20).relevance_min == pytest.approx(-0.3)  # the base edge is the higher
    assert quantile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.5 and quantile([5.0], 0.1) == 5.0
    with pytest.raises(ValueError):
        calibrate(base[:7])  # fewer than 8 replies: the edges would be noise
    # A confident model's fluency clusters (-0.60..-0.70): the edge keeps 0.5 nats below the 10th
    # percentile, not the 0.09 the spread alone would leave, so a fluent -0.82 reply stays sane.
    tight = calibrate([q(relevance=0.5, fluency=-0.6 - r / 100, rep=0.0) for r in range(11)])
    assert tight.fluency_min == pytest.approx(-0.69 - 0.5)
    assert sane(q(relevance=0.5, fluency=-0.82, rep=0.0), tight) and not sane(q(relevance=0.5, fluency=-1.3, rep=0.0), tight)


def test_calibration_round_trips_through_json():
    cal = calibrate([q(relevance=0.5 + i / 100, fluency=-1.2 - i / 50) for i in range(16)], [0.1, 0.2, 0.3])
    assert Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))) == cal
    no_chance = Calibration(0.3, -2.0, 0.25, 16, 0.6, -1.4, 0.0)
    assert Calibration.from_dict(json.loads(json.dumps(no_chance.to_dict()))) == no_chance
    with pytest.raises(ValueError):
        Calibration.from_dict({**cal.to_dict(), "surprise": 1})
    with pytest.raises(ValueError):
        Calibration.from_dict({"relevance_min": 0.3})


def test_sane_decisions_at_the_edges():
    cal = Calibration(relevance_min=0.3, fluency_min=-2.0, repetition_max=0.25, n=16, relevance_median=0.6,
                      fluency_median=-1.4, repetition_median=0.0)
    assert sane(q(0.3, -2.0, 0.25), cal)  # edges are inside the normal range
    assert not sane(q(0.29, -1.0, 0.0), cal) and insane_because(q(0.29), cal) == ["relevance 0.290 < 0.300"]
    assert not sane(q(0.9, -2.01, 0.0), cal)
    assert not sane(q(0.9, -1.0, 0.26), cal)
    assert not sane(q(0.9, None, 0.0), cal)
    assert len(insane_because(q(0.0, -5.0, 0.9), cal)) == 3


def test_summary_means_sane_rate_and_preferred_and_sane():
    cal = Calibration(0.3, -2.0, 0.25, 16, 0.6, -1.4, 0.0)
    replies = [q(0.8, -1.0, 0.0, kl=0.1, entropy=1.0), q(0.1, -1.0, 0.0, kl=0.3, entropy=0.5),
               q(0.6, -3.0, 0.5, kl=0.2, entropy=0.0), q(0.5, -1.5, 0.1, kl=0.0, entropy=1.5)]
    s = summarize(replies, cal, preferred=[True, True, True, False])
    assert s.n == 4 and s.sane_rate == 0.5 and s.preferred_and_sane == 0.25
    assert (s.relevance, s.fluency, s.repetition) == pytest.approx((0.5, -1.625, 0.15))
    assert (s.kl, s.entropy) == pytest.approx((0.15, 0.75))
    without = summarize([q(0.8), q(0.8, kl=0.1, entropy=1.0)], cal)
    assert without.kl is None and without.entropy is None and without.preferred_and_sane is None
    assert json.loads(json.dumps(s.to_dict()))["sane_rate"] == 0.5
    with pytest.raises(ValueError):
        summarize(replies, cal, preferred=[True])
    with pytest.raises(ValueError):
        summarize([], cal)


def test_paired_verdict_both_ways():
    reference = Summary(n=32, relevance=0.6, fluency=-1.4, repetition=0.01, sane_rate=0.9, kl=0.0, entropy=1.2)
    close = Summary(n=32, relevance=0.58, fluency=-1.5, repetition=0.02, sane_rate=0.84, kl=0.05, entropy=1.1)
    degenerate = Summary(n=32, relevance=0.1, fluency=-3.2, repetition=0.0, sane_rate=0.12, kl=0.9, entropy=0.2)
    ok = not_worse(close, reference, bound=0.1, max_kl=0.5)
    assert ok.ok and ok.reason.startswith("not worse") and "0.84 vs 0.90" in ok.reason
    bad = not_worse(degenerate, reference, bound=0.1, max_kl=0.5)
    assert not bad.ok and "sane rate 0.12 vs 0.90" in bad.reason and "KL 0.900" in bad.reason
    assert not not_worse(close, reference, bound=0.05).ok  # 0.06 lower is past a 0.05 bound
    assert not_worse(reference, close, bound=0.0).ok  # better always passes
    drifted = Summary(n=32, relevance=0.6, fluency=-1.4, repetition=0.0, sane_rate=0.9, kl=0.7, entropy=0.4)
    verdict = not_worse(drifted, reference, max_kl=0.5)
    assert not verdict.ok and verdict.reason == "worse: KL 0.700 nats/token (max 0.500)"
    with pytest.raises(ValueError):
        not_worse(Summary(n=8, relevance=0.6, fluency=-1.4, repetition=0.0, sane_rate=0.9), reference)
    with pytest.raises(ValueError):
        not_worse(Summary(n=32, relevance=0.6, fluency=-1.4, repetition=0.0, sane_rate=0.9), reference, max_kl=0.5)


def test_meter_calibrates_with_the_chance_edge_of_other_requests(engine, embedder, generations):
    replies = [Reply.from_generation(m, g, drift=False) for m, g in generations]
    cal, measured = run(QualityMeter(engine, embedder).calibrate(replies))
    chance = _chance(embedder, replies)
    assert cal == calibrate(measured, chance or None)
    # These requests are one question reworded ("Question number i: tell me something."): no other topic to
    # pair with, so no chance edge (it would otherwise sit above the replies' own relevance).
    assert cal.n == sum(not r.empty for r in replies) and (cal.relevance_chance is None) == (not chance)


def _chance(embedder, replies):
    """Cosines of each non-empty reply with every request on another topic (requests less similar
    than SAME_TOPIC to its own), computed the slow way."""
    requests = [request_text(r.messages) for r in replies]
    out = []
    for reply, own in zip(replies, requests):
        if reply.empty:
            continue
        for other in dict.fromkeys(requests):
            mine, theirs = embedder([own, other])
            if float(mine @ theirs) < SAME_TOPIC:
                a, b = embedder([reply.text, other])
                out.append(float(a @ b))
    return out


def test_a_reply_in_a_script_its_request_has_none_of_is_not_sane():
    from clawr1.quality.measures import foreign_script

    english = "How can I make my small apartment feel bigger?"
    assert foreign_script("**Eco-Friendly能源**: Design your space with solar panels.", english)
    assert foreign_script("Use mirrors. Это помогает.", english)
    assert not foreign_script("Use mirrors and light colours; keep the floor clear.", english)
    assert not foreign_script("The area is πr², with α the angle.", english)  # Greek: mathematics
    assert not foreign_script("Try the café, or say 能.", english)  # one letter: a quote, a name
    assert not foreign_script("可以用镜子。", "我怎样让小公寓显得更大？")  # asked in Chinese, answered in it


def test_a_tool_call_is_not_held_to_relevance_and_its_range_is_set_by_prose():
    prose = [q(relevance=0.4 + r / 50, fluency=-1.0 - r / 20) for r in range(10)]
    calls = [q(relevance=0.05, fluency=-0.1, tool_call=True) for _ in range(6)]
    cal = calibrate(prose + calls)
    assert cal.relevance_median == pytest.approx(calibrate(prose).relevance_median)  # calls set no range
    assert cal.n == 16  # but count towards fluency's
    off = q(relevance=0.05, fluency=-1.2)
    assert insane_because(off, cal) == [f"relevance 0.050 < {cal.relevance_min:.3f}"]
    assert insane_because(q(relevance=0.05, fluency=-1.2, tool_call=True), cal) == []
    broken = q(relevance=0.05, fluency=-9.0, tool_call=True)  # a call in broken language still is not sane
    assert insane_because(broken, cal) == [f"fluency -9.000 < {cal.fluency_min:.3f}"]
    # With only calls to calibrate on, relevance's range falls back to theirs.
    assert calibrate(calls * 2).relevance_median == pytest.approx(0.05)


def test_the_meter_does_not_call_a_copied_tool_call_an_echo(engine, embedder):
    request = 'Add them. To do it, answer with only:\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}'
    messages = [{"role": "user", "content": request}]
    text = '{"name": "calculator", "arguments": {"expression": "2 + 3"}}'
    ids, prompt = engine.tokenizer.encode(text, add_special_tokens=False), engine.render(messages)
    as_text, as_call = run(QualityMeter(engine, embedder).measure(
        [Reply(messages, text, ids, prompt), Reply(messages, text, ids, prompt, tool_call=True)]))
    assert as_text.echo and not as_text.tool_call
    assert not as_call.echo and as_call.tool_call and as_call.to_dict()["tool_call"]
