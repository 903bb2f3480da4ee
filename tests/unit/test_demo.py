"""The personal-agent demo's pieces: preference checkers, user reactions, scoring, evaluation."""

from __future__ import annotations

import json

import openai

from clawr1.demo.evaluate import evaluate
from clawr1.demo.plot import plot_runs, smoothed
from clawr1.demo.run import Scoreboard, version_of
from clawr1.demo.users import CUT_OFF, PREFERENCES, make_users, one_short_paragraph
from tests.conftest import run
from tests.gateway_helpers import live_gateway, steps_of

LONG = "Tea is lovely.\n\nFirst boil water. " + "word " * 60


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


def test_users_correct_when_broken_and_move_on_when_kept():
    users = make_users(6, seed=3)
    assert [u.preference.name for u in users] == ["short", "no-bold", "no-steps"] * 2
    user = users[1]  # no-bold
    kept, said = user.react("Use **fresh** leaves.", True)
    assert not kept and said in PREFERENCES["no-bold"].corrections
    kept, said = user.react("Use fresh leaves and hot water.", True)
    assert kept and said.endswith("?") and any(said.startswith(t) for t in ("Thanks", "Great", "Perfect", "Nice"))
    kept, said = user.react("Use fresh leaves and hot", False)  # cut off at the length cap
    assert not kept and said in CUT_OFF
    # Seeded: the same seed gives the same conversation, another seed another one.
    a, b, c = make_users(1, seed=5)[0], make_users(1, seed=5)[0], make_users(1, seed=6)[0]
    qa, qb, qc = ([u.next_question() for _ in range(8)] for u in (a, b, c))
    assert qa == qb and qa != qc


def test_scoreboard_and_smoothing():
    board = Scoreboard()
    for version, kept in [(0, False), (0, True), (1, True), (2, True), (2, False)]:
        board.add(version, kept)
    rows = board.per_version()
    assert [(r["version"], r["replies"], r["score"]) for r in rows] == [(0, 2, 0.5), (1, 1, 1.0), (2, 2, 0.5)]
    assert board.latest() == 2 and version_of("clawr1-v12") == 12 and version_of(None) == -1
    xs, ys = smoothed(rows, window=2)
    assert xs == [0, 1, 2] and ys[1] == (1 + 1) / 3 and ys[2] == (1 + 1) / 3


def test_plot_writes_a_png(tmp_path):
    result = {"method": "combine", "reached_version": 2, "per_version": [
        {"version": 0, "replies": 4, "score": 0.25}, {"version": 1, "replies": 4, "score": 0.5},
        {"version": 2, "replies": 4, "score": 0.75}], "before": {"score": 0.3}, "after": {"score": 0.8}}
    out = plot_runs([result], tmp_path / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_evaluation_is_recorded_but_never_trained(engine, tmp_path):
    """Held-out prompts go through the gateway as side turns: stored, never samples."""
    questions = ("How do I boil an egg?", "How do I sleep better?")
    users = make_users(3, seed=1)

    async def measure(base: str):
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client:
            return await evaluate(client, users, max_tokens=4, temperature=1.0, questions=questions)

    with live_gateway(engine, tmp_path) as (base, pool):
        result = run(measure(base))
        assert result.n == 6 and set(result.by_preference) == {"short", "no-bold", "no-steps"}
        assert result.versions == {"clawr1-v0": 6}
        steps = steps_of(pool, 6)
        assert len(steps) == 6 and all(s.turn_type == "side" for s in steps)
        stats = pool.stats()
        assert stats["main_steps"] == 0 and stats["pending"] + stats["ready"] == 0
        # Paired: a second evaluation samples the same replies (same prompts, same seeds).
        again = run(measure(base))
        assert again.score == result.score and again.mean_words == result.mean_words


def test_eval_command_measures_the_served_version(engine, tmp_path, capsys):
    from clawr1.cli.main import main

    with live_gateway(engine, tmp_path) as (base, pool):
        assert main(["eval", "--scenario", "personal", "--base-url", base, "--max-tokens", "4", "--json"]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["n"] == 24 and result["versions"] == {"clawr1-v0": 24} and 0 <= result["score"] <= 1
        assert len(steps_of(pool, 24)) == 24 and pool.stats()["main_steps"] == 0  # measured, never trained
