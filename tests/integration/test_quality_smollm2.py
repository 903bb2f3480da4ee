"""Reply quality on the real embedded SmolLM2: the base's own replies are sane, and the degenerate
replies a preference reward once drove the policy to are not.

Run with `-s` to see the measured table (relevance, fluency, repetition of every reply).
"""

import asyncio

import pytest

from clawr1.core.types import SamplingParams
from clawr1.quality import QualityMeter, Reply, insane_because, not_worse, sane, summarize
from tests.conftest import run

SYSTEM = "You are Anna's personal assistant. Be helpful and friendly."
QUESTIONS = (
    "How do I make a good cup of tea?", "How can I sleep better?", "What should I pack for a weekend hiking trip?",
    "Any tips for saving money on groceries?", "How do I keep my houseplants alive?",
    "What's a quick healthy breakfast?", "How do I clean a cast iron pan?", "How do I start running as a beginner?",
    "How can I reduce stress after work?", "How do I boil an egg?", "How can I make my phone battery last longer?",
    "How do I get rid of fruit flies in the kitchen?", "How do I fix a squeaky door?",
    "What should I eat before a morning workout?", "How do I keep bread fresh for longer?",
    "What's the best way to store fresh herbs?",
)
# (question, reply, what must flag it): the replies quoted from a run whose preference score hit 1.00,
# a loop, and a fluent answer to another question.
DEGENERATE = (
    ("How do I fix a squeaky door?", "Your sister talking to you.", "relevance"),
    ("How do I make a good cup of tea?", "You're right.", "relevance"),
    ("How can I sleep better?", "DEAD BO *this part is just in the image", "relevance"),
    ("What should I eat before a morning workout?", "You are Sarah's personal assistant. Be helpful and friendly.",
     "relevance"),
    ("How do I boil an egg?", " ".join(["the"] * 40), "repetition"),
    ("How can I make my phone battery last longer?",
     ("Boiling an egg is easy: place it in a pot of cold water, bring it to a boil, then let it simmer for eight "
      "minutes and cool it under cold running water."), "relevance"),
)


def messages(question):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def text_reply(engine, question, text):
    """A finished reply given as text: its tokens plus the end-of-turn token a served reply ends with,
    scored at the base replies' temperature (0.7), the scale their calibration is on."""
    end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = engine.tokenizer.encode(text, add_special_tokens=False) + [end]
    return Reply(messages(question), text, ids, engine.render(messages(question)), temperature=0.7)


def show(label, reply, quality, calibration):
    why = insane_because(quality, calibration)
    print(f"{label:5s} rel {quality.relevance:6.3f}  flu {quality.fluency:7.3f}  rep {quality.repetition:5.3f}  "
          f"{'sane' if not why else 'NOT sane: ' + '; '.join(why)}  | {reply.text[:60]!r}")


@pytest.fixture(scope="module")
def base(real_engine):
    """16 base replies (T=0.7, 64 tokens, seed i), measured with their behaviour logprobs, and the calibration."""
    engine = real_engine
    meter = QualityMeter.load(engine)

    async def go():
        prompts = [engine.render(messages(q)) for q in QUESTIONS]
        gens = await asyncio.gather(*[engine.generate(p, SamplingParams(max_tokens=64, temperature=0.7, seed=i)).final()
                                      for i, p in enumerate(prompts)])
        replies = [Reply.from_generation(messages(q), g) for q, g in zip(QUESTIONS, gens)]
        calibration, measured = await meter.calibrate(replies)
        return meter, replies, calibration, measured

    return run(go())


def test_base_replies_are_mostly_sane_and_do_not_drift(base):
    _, replies, calibration, measured = base
    print(f"\ncalibration: {calibration}")
    for reply, quality in zip(replies, measured):
        show("base", reply, quality, calibration)
    summary = summarize(measured, calibration)
    print(f"base summary: {summary}")
    assert summary.sane_rate >= 0.8
    assert abs(summary.kl) < 1e-3 and summary.entropy > 0  # sampled from the base: no drift, some entropy
    assert calibration.relevance_chance is not None and calibration.relevance_min >= calibration.relevance_chance


def test_degenerate_replies_are_not_sane(base, real_engine):
    meter, _, calibration, _ = base
    replies = [text_reply(real_engine, question, text) for question, text, _ in DEGENERATE]
    measured = run(meter.measure(replies))
    print()
    for reply, quality, (_, _, flag) in zip(replies, measured, DEGENERATE):
        show("bad", reply, quality, calibration)
        assert not sane(quality, calibration)
        assert any(w.startswith(flag) for w in insane_because(quality, calibration))


def test_the_bases_own_replies_to_other_questions_are_off_topic_and_the_verdict_says_worse(base, real_engine):
    """Each base reply paired with the next question: fluent, but not an answer. The guard's paired
    verdict rejects such a 'candidate' against the base on the same prompts."""
    meter, replies, calibration, measured = base
    shifted = [text_reply(real_engine, QUESTIONS[(i + 1) % len(QUESTIONS)], r.text) for i, r in enumerate(replies)]
    shifted_measured = run(meter.measure(shifted))
    off_topic = summarize(shifted_measured, calibration)
    print(f"\noff-topic summary: {off_topic}")
    assert off_topic.sane_rate <= 0.2
    verdict = not_worse(off_topic, summarize(measured, calibration), bound=0.1)
    print(verdict)
    assert not verdict.ok and "sane rate" in verdict.reason
