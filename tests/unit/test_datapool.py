"""The data pool's log: idempotent writes, next-state pairing, rewards, sessions, reads, export.

The contract runs on both backends, a real SQLite file in tmp_path and a real PostgreSQL server
(`pool` fixture); what only SQLite has (its file lock, its parameter limit, old files) runs there.
"""

import asyncio
import json
import sqlite3

import pytest

from clawr1.core.config import PoolConfig
from clawr1.core.records import Hint, Reward, Step
from clawr1.datapool import POOL_FILE, PoolFullError, SQLitePool, UnknownSessionError, UnknownStepError


def conversation(turn: int) -> list[dict]:
    """The messages a stock client sends at `turn`: full history, then the newest user message."""
    messages = [{"role": "system", "content": "be brief"}]
    for t in range(turn):
        messages += [{"role": "user", "content": f"question {t}"}, {"role": "assistant", "content": f"answer {t}"}]
    return messages + [{"role": "user", "content": f"question {turn}"}]


def make_step(step_id: str, session: str = "s1", turn: int = 0, turn_type: str = "main", version: int = 0,
              tenant: str = "default", messages: list[dict] | None = None) -> Step:
    return Step(step_id=step_id, tenant=tenant, session_id=session, prompt_id=f"{session}-p", turn_index=turn,
                turn_type=turn_type, messages=messages or conversation(turn), tools=None, prompt_ids=[1, 2, 3],
                token_ids=[7, 8, 9], logprobs=[-0.5, -1.25, -0.125], text=f"answer {turn}", policy_version=version,
                adapter=None, finish_reason="stop", temperature=1.0, timings={"total_ms": 3.5})


@pytest.fixture
def pool(open_test_pool):
    """The contract holds on each backend: the SQLite file and PostgreSQL."""
    return open_test_pool()


def test_every_pool_config_field_has_a_docstring():
    for name, field in PoolConfig.model_fields.items():
        assert field.description, f"PoolConfig.{name} has no docstring"


def test_step_round_trips_token_for_token(pool, tmp_path):
    step = make_step("a")
    step.logprobs = [-0.1, -1e-12, -23.456789012345678]  # float64: the importance ratio needs them exact
    step.prompt_ids, step.tools = list(range(5000)), [{"type": "function", "function": {"name": "ls"}}]
    assert pool.append_step(step) is True
    (back,) = pool.get_steps(["a"])
    assert back == step
    if isinstance(pool, SQLitePool):
        assert sqlite3.connect(tmp_path / POOL_FILE).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_tokens_and_logprobs_must_line_up():
    with pytest.raises(ValueError, match="2 token ids but 1 logprobs"):
        Step(step_id="x", tenant="t", session_id="s", prompt_id="p", turn_index=0, turn_type="main", messages=[],
             tools=None, prompt_ids=[], token_ids=[1, 2], logprobs=[-1.0], text="", policy_version=0, adapter=None,
             finish_reason="stop", temperature=1.0)
    with pytest.raises(ValueError, match="in \\[-1, 1\\]"):
        Reward(step_id="x", score=1.5, source="judge")


def test_a_replayed_step_id_is_stored_once(pool):
    first = make_step("a")
    assert pool.append_step(first) is True
    replay = make_step("a", turn=5)  # a retry with different content: the first write stands
    assert pool.append_step(replay) is False
    assert pool.append_steps([make_step("b"), make_step("b"), make_step("a")]) == [True, False, False]
    assert pool.stats()["steps"] == 2 and pool.stats()["main_steps"] == 2
    assert pool.get_steps(["a"])[0].turn_index == 0


def test_the_next_main_turn_is_the_next_state(pool):
    pool.append_steps([make_step("t0", turn=0), make_step("side", turn=1, turn_type="side"),
                       make_step("t1", turn=1), make_step("other", session="s2", turn=1)])
    t0, t1, side = pool.get_steps(["t0", "t1", "side"])
    assert t0.next_state == [{"role": "user", "content": "question 1"}]
    assert t1.next_state is None and side.next_state is None  # not yet / side turns are never paired
    tool_turn = conversation(2)[:-1] + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
                                        {"role": "tool", "tool_call_id": "c1", "content": "exit code 1"}]
    pool.append_step(make_step("t2", turn=2, messages=tool_turn))
    assert pool.get_steps(["t1"])[0].next_state == [{"role": "tool", "tool_call_id": "c1", "content": "exit code 1"}]
    assert pool.show("t1")["next_step_id"] == "t2"
    # ... and the other way round: the main turn each one follows (what `trainer.relabel` reads)
    assert pool.previous_turns(["t1", "t2", "t0", "side", "other"]) == {"t1": "t0", "t2": "t1"}


def test_pairing_survives_out_of_order_arrival_and_keeps_tenants_apart(pool):
    pool.append_step(make_step("t3", turn=3))
    pool.append_step(make_step("t1", turn=1))
    pool.append_step(make_step("x2", turn=2, tenant="other"))  # same session id, another tenant
    assert pool.show("t1")["next_step_id"] == "t3"
    pool.append_steps([make_step("t2", turn=2), make_step("t0", turn=0)])
    links = {s["step_id"]: s["next_step_id"] for s in pool.show("s1", tenant="default")["steps"]}
    assert links == {"t0": "t1", "t1": "t2", "t2": "t3", "t3": None}
    assert pool.show("x2")["next_step_id"] is None
    with pytest.raises(ValueError, match="tenants"):
        pool.show("s1")


def test_rewards_make_samples_ready_and_the_latest_wins(pool):
    pool.append_steps([make_step("a", turn=0), make_step("b", turn=1), make_step("c", turn=2, turn_type="side")])
    pool.add_reward(Reward(step_id="a", score=1.0, source="judge", votes=[1, 1, 0], evidence="user said thanks"))
    pool.add_reward(Reward(step_id="b", score=0.0, source="judge"))
    assert pool.stats()["ready"] == 1 and pool.stats()["pending"] == 1
    pool.add_reward(Reward(step_id="a", score=0.0, source="feedback"))  # explicit feedback overrides the judge
    assert pool.stats()["ready"] == 0
    assert pool.mark_ready("b") is True and pool.mark_ready("b") is False
    assert pool.mark_ready("c") is False  # side turns never train
    pool.add_hint(Hint(step_id="b", text="check the exit code first", source="judge"))
    detail = pool.show("a")
    assert [r["source"] for r in detail["rewards"]] == ["judge", "feedback"]
    assert detail["rewards"][0]["votes"] == [1, 1, 0] and detail["sample"]["reward"] == 0.0
    assert pool.show("b")["hints"][0]["text"] == "check the exit code first"


def test_a_judgement_is_one_write_and_a_hinted_zero_is_ready(pool):
    """The judge's reward, hint and readiness land in one commit: all of it or, when the worker is
    stopped before the commit (its future cancelled in the queue), none of it."""
    pool.append_steps([make_step("a", turn=0), make_step("b", turn=1), make_step("c", turn=2)])
    pool.add_judgement(Reward(step_id="a", score=0.0, source="judge"), Hint(step_id="a", text="be brief", source="judge"))
    pool.add_judgement(Reward(step_id="b", score=0.0, source="judge"), None)
    a, b = pool.show("a"), pool.show("b")
    assert a["sample"]["status"] == "ready" and [h["text"] for h in a["hints"]] == ["be brief"]
    assert b["sample"]["status"] == "pending" and b["hints"] == [] and b["sample"]["reward"] == 0
    with pytest.raises(ValueError, match="hint is for"):
        pool.submit_judgement(Reward(step_id="a", score=1.0, source="judge"), Hint(step_id="b", text="x", source="judge"))
    with pytest.raises(UnknownStepError):  # the reward's step is unknown: its hint is not stored either
        pool.add_judgement(Reward(step_id="nope", score=0.0, source="judge"), Hint(step_id="nope", text="x", source="judge"))
    assert pool.stats()["rewards"] == 2 and pool.stats()["hints"] == 1


def test_a_bad_write_fails_alone(pool):
    pool.append_step(make_step("a"))
    good, bad = (pool.submit_reward(Reward(step_id=s, score=1.0, source="judge")) for s in ("a", "nope"))
    with pytest.raises(UnknownStepError):
        bad.result()
    assert good.result() is None and pool.stats()["rewards"] == 1
    with pytest.raises(UnknownStepError):
        pool.add_hint(Hint(step_id="nope", text="x", source="judge"))


def test_closing_a_session_decides_its_last_turn(pool):
    pool.append_steps([make_step("a0", "A", 0), make_step("a1", "A", 1), make_step("b0", "B", 0)])
    assert pool.close_session("A", outcome_reward=1.0) is True
    assert pool.close_session("A", outcome_reward=-1.0) is False  # closing twice is harmless
    assert pool.show("a1")["rewards"][0]["source"] == "outcome" and pool.show("a1")["sample"]["status"] == "ready"
    assert pool.close_session("B", reason="idle") is True
    masked = pool.show("b0")["sample"]
    assert (masked["status"], masked["reason"]) == ("dropped", "masked")
    assert [e["kind"] for e in pool.show("B")["events"]] == ["close", "mask"]
    with pytest.raises(UnknownSessionError):
        pool.close_session("nope")
    with pytest.raises(ValueError):
        pool.close_session("A", outcome_reward=2.0)


def test_every_choice_of_a_turn_gets_the_next_turn_in_any_order(pool):
    """n > 1: a reply's choices (`<id>-0`, `<id>-1`) share a turn index; each one's next state is
    the next turn, whether it comes in a later commit, an earlier one or the same one."""
    orders = {"in order": [["a-0", "a-1"], ["b-0"]], "next turn first": [["b-0"], ["a-0", "a-1"]],
              "one batch": [["a-0", "a-1", "b-0"]], "one choice late": [["a-0"], ["b-0"], ["a-1"]]}
    for n, (name, commits) in enumerate(orders.items()):
        session = f"n{n}"
        for ids in commits:
            pool.append_steps([make_step(f"{session}{i}", session, 0 if i.startswith("a") else 1) for i in ids])
        links = {s["step_id"]: s["next_step_id"] for s in pool.show(session)["steps"]}
        assert links == {f"{session}a-0": f"{session}b-0", f"{session}a-1": f"{session}b-0", f"{session}b-0": None}, name
        assert {f"{session}a-0", f"{session}a-1"} <= set(pool.unjudged()), name


def test_closing_a_session_decides_every_choice_of_its_last_turn(pool):
    pool.append_steps([make_step("x0", "X", 0), make_step("x1-0", "X", 1), make_step("x1-1", "X", 1),
                       make_step("y0-0", "Y", 0), make_step("y0-1", "Y", 0)])
    pool.close_session("X", outcome_reward=1.0)
    pool.close_session("Y", reason="idle")
    assert [(pool.show(s)["sample"]["status"], pool.show(s)["sample"]["reward"]) for s in ("x1-0", "x1-1")] == [
        ("ready", 1.0), ("ready", 1.0)]
    assert [(pool.show(s)["sample"]["status"], pool.show(s)["sample"]["reason"]) for s in ("y0-0", "y0-1")] == [
        ("dropped", "masked"), ("dropped", "masked")]
    assert pool.stats()["pending"] == 1  # x0, waiting for the judge


def test_a_masked_turn_waits_for_the_judge_again_when_its_session_goes_on(pool):
    """The idle close masks the last turn (no next state); the user comes back: the session reopens,
    the turn has its next state and the judge gets it."""
    pool.append_steps([make_step("a0", turn=0), make_step("a1", turn=1)])
    pool.close_session("s1", reason="idle")
    assert pool.show("a1")["sample"]["status"] == "dropped"
    pool.append_step(make_step("a2", turn=2))
    assert (pool.show("a1")["sample"]["status"], pool.show("a1")["sample"]["reason"]) == ("pending", None)
    assert set(pool.unjudged()) == {"a0", "a1"}
    assert pool.get_steps(["a1"])[0].next_state == [{"role": "user", "content": "question 2"}]


def test_a_correction_without_a_score_is_a_distillation_sample(pool):
    """Feedback that corrects (a hint) with score 0 or no score makes the turn trainable, as the
    judge's hinted zero does, even the last turn of a session that closes (or closed) without one."""
    pool.append_steps([make_step("f0", "F", 0), make_step("f1", "F", 1), make_step("c0", "C", 0),
                       make_step("m0", "M", 0)])
    pool.add_feedback(session_id="F", turn_index=0, score=0.0, correction="be concise")
    pool.add_feedback(session_id="C", correction="Do not use bold text.")
    pool.close_session("C", reason="idle")
    pool.close_session("M", reason="idle")
    pool.add_feedback(session_id="M", correction="Answer the question first.")
    for step_id, reward in (("f0", 0.0), ("c0", None), ("m0", None)):
        sample = pool.show(step_id)["sample"]
        assert (sample["status"], sample["reward"], sample["reason"]) == ("ready", reward, None), step_id
        assert pool.show(step_id)["hints"], step_id
    assert "f0" not in pool.unjudged()  # the person's word stands; the judge does not override it


def test_stats_and_sessions_count_everything(pool):
    pool.append_steps([make_step(f"s{i}-{t}", f"s{i}", t) for i in range(3) for t in range(2)])
    pool.append_step(make_step("side", "s0", 2, turn_type="side"))
    pool.add_reward(Reward(step_id="s0-0", score=1.0, source="judge"))
    pool.add_hint(Hint(step_id="s0-0", text="be shorter", source="judge"))
    pool.close_session("s2")
    stats = pool.stats()
    assert {k: stats[k] for k in ("sessions", "open_sessions", "steps", "main_steps", "rewards", "hints")} == {
        "sessions": 3, "open_sessions": 2, "steps": 7, "main_steps": 6, "rewards": 1, "hints": 1}
    assert (stats["pending"], stats["ready"], stats["leased"], stats["consumed"], stats["dropped"]) == (4, 1, 0, 0, 1)
    assert stats["dropped_by_reason"] == {"masked": 1}
    assert json.loads(json.dumps(stats)) == stats  # `clawr1 pool stats --json` prints it as is
    listed = {s["session_id"]: s for s in pool.sessions()}
    assert listed["s0"]["steps"] == 3 and listed["s2"]["status"] == "closed"
    with pytest.raises(KeyError):
        pool.show("missing")


def test_export_jsonl_loads_back_in_trl_form(pool, tmp_path):
    pool.append_steps([make_step("a", turn=0), make_step("b", turn=1), make_step("c", turn=2, turn_type="side")])
    pool.add_reward(Reward(step_id="a", score=-1.0, source="judge"))
    assert pool.export(tmp_path / "all.jsonl") == 2
    rows = [json.loads(line) for line in (tmp_path / "all.jsonl").read_text().splitlines()]
    assert rows[0]["prompt"] == conversation(0) and rows[0]["reward"] == -1.0
    assert rows[0]["completion"] == [{"role": "assistant", "content": "answer 0"}]
    assert json.loads(rows[0]["next_state"]) == [{"role": "user", "content": "question 1"}]
    assert rows[1]["reward"] is None
    assert pool.export(tmp_path / "rewarded.jsonl", rewarded_only=True) == 1
    with pytest.raises(ValueError, match="jsonl or parquet"):
        pool.export(tmp_path / "x.csv", "csv")


def test_export_parquet(pool, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (parquet export is optional)")
    pool.append_steps([make_step("a", turn=0), make_step("b", turn=1)])
    assert pool.export(tmp_path / "x.parquet", "parquet") == 2
    assert pq.read_table(tmp_path / "x.parquet").to_pylist()[1]["prompt"][-1]["content"] == "question 1"


def test_export_parquet_takes_tool_call_arguments_as_sent_text_or_object(pool, tmp_path):
    """The gateway accepts a tool call's arguments as JSON text (OpenAI's form) or as an object:
    a Parquet column needs one type (and cannot hold an empty object), so they export as text."""
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (parquet export is optional)")

    def calling(arguments) -> list[dict]:
        return [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]

    pool.append_steps([make_step("a", "A", messages=calling('{"city": "Paris"}')),
                       make_step("b", "B", messages=calling({"city": "Rome"})), make_step("c", "C", messages=calling({}))])
    assert pool.export(tmp_path / "x.parquet", "parquet") == 3
    rows = pq.read_table(tmp_path / "x.parquet").to_pylist()
    assert [r["prompt"][1]["tool_calls"][0]["function"]["arguments"] for r in rows] == [
        '{"city": "Paris"}', '{"city": "Rome"}', "{}"]


def test_nul_characters_are_stored_on_both_backends(pool):
    """A reply, a correction or an id with NUL: SQLite stores it, PostgreSQL's text cannot (it was a
    500 and a lost step there); it stores U+FFFD instead, and a lookup by such an id finds nothing."""
    nul = make_step("n-0", "N")
    nul.text = "a\x00b"
    assert pool.append_step(nul) is True
    assert pool.add_feedback(session_id="N", score=0.5, correction="use \x00 here") == ["n-0"]
    assert pool.get_steps(["n-0"])[0].text in ("a\x00b", "a\ufffdb")
    assert pool.show("n-0")["hints"][0]["text"] in ("use \x00 here", "use \ufffd here")
    with pytest.raises(UnknownSessionError):
        pool.add_feedback(session_id="N\x00", score=0.5)
    assert pool.write_error() is None


def test_async_callers_share_group_commits(pool):
    async def main():
        await asyncio.gather(*(asyncio.wrap_future(pool.submit_step(make_step(f"a{i}", f"s{i % 7}", i)))
                               for i in range(300)))
    asyncio.run(main())
    assert pool.stats()["steps"] == 300


def test_a_full_queue_refuses_instead_of_losing_data(tmp_path):
    config = PoolConfig(writer_queue=4, busy_timeout_s=5)
    with SQLitePool(tmp_path, config) as pool:
        blocker = sqlite3.connect(tmp_path / POOL_FILE, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # another process holds the write lock: the writer waits
        futures = []
        with pytest.raises(PoolFullError):
            for i in range(50):
                futures.append(pool.submit_step(make_step(f"a{i}", turn=i)))
        blocker.execute("ROLLBACK")
        assert all(f.result() for f in futures)
        assert pool.stats()["steps"] == len(futures)


def test_a_batch_larger_than_one_statement_is_split(tmp_path):
    from clawr1.datapool import ops
    from clawr1.datapool.schema import connect, ensure_schema, step_row

    conn = connect(tmp_path / POOL_FILE, PoolConfig())
    ensure_schema(conn)
    conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 40)  # 2 step rows a statement
    rows = [step_row(make_step(f"t{t}", turn=t)) for t in (4, 0, 2, 1, 3)]
    conn.execute("BEGIN IMMEDIATE")
    assert ops.insert_steps(conn, rows + rows[:1]) == [True] * 5 + [False]
    conn.execute("COMMIT")
    links = dict(conn.execute("SELECT step_id, next_step_id FROM samples").fetchall())
    assert links == {"t0": "t1", "t1": "t2", "t2": "t3", "t3": "t4", "t4": None}
    conn.close()


def test_a_new_step_reopens_its_closed_session_and_a_replay_does_not(pool):
    pool.append_steps([make_step("a0", "A", 0), make_step("a1", "A", 1)])
    assert pool.close_session("A", reason="idle") is True
    assert pool.append_step(make_step("a1", "A", 1)) is False  # a replay changes nothing
    assert pool.show("A")["status"] == "closed"
    assert pool.append_steps([make_step("a3", "A", 3), make_step("a2", "A", 2)]) == [True, True]
    session = pool.show("A")
    assert (session["status"], session["closed_at"]) == ("open", None)
    links = {s["step_id"]: s["next_step_id"] for s in session["steps"]}
    assert links == {"a0": "a1", "a1": "a2", "a2": "a3", "a3": None}
    assert pool.stats()["open_sessions"] == 1 and pool.stats()["main_steps"] == 4


def test_explicit_feedback_is_not_overridden_by_a_later_judge(pool):
    pool.append_step(make_step("fb-0", "s", 0))
    pool.add_reward(Reward(step_id="fb-0", score=-1.0, source="feedback"))
    pool.add_reward(Reward(step_id="fb-0", score=1.0, source="judge"))  # judged before the feedback landed
    detail = pool.show("fb-0")
    assert detail["sample"]["reward"] == -1.0
    assert [r["source"] for r in detail["rewards"]] == ["feedback", "judge"]  # both kept as history


def test_a_pool_from_before_session_keys_is_upgraded(tmp_path):
    import sqlite3

    from clawr1.datapool import POOL_FILE

    conn = sqlite3.connect(tmp_path / POOL_FILE)
    conn.execute("CREATE TABLE sessions (tenant TEXT NOT NULL, session_id TEXT NOT NULL, status TEXT NOT NULL, "
                 "created_at REAL NOT NULL, updated_at REAL NOT NULL, closed_at REAL, outcome_reward REAL, "
                 "PRIMARY KEY (tenant, session_id))")
    conn.execute("INSERT INTO sessions VALUES ('default', 'old', 'open', 1, 1, NULL, NULL)")
    conn.commit()
    conn.close()
    with SQLitePool(tmp_path) as pool:
        assert pool.open_session("new", key_hash="h" * 64)
        assert pool.session_by_key("h" * 64) == ("default", "new", "open")
        assert pool.stats()["sessions"] == 2


def test_the_judge_gets_unjudged_turns_by_shard_retries_failures_and_gives_up(pool, pool_later):
    import time

    from clawr1.datapool.schema import shard_key

    pool.append_steps([make_step(f"s{i}-{t}", f"s{i}", t) for i in range(8) for t in range(2)])
    waiting = sorted(f"s{i}-0" for i in range(8))  # turn 1 has no next state yet
    assert sorted(pool.unjudged()) == waiting
    shards = [pool.unjudged(shard=(i, 3)) for i in range(3)]
    assert sorted(sum(shards, [])) == waiting and all(shards)
    assert all(shard_key(step_id) % 3 == i for i, ids in enumerate(shards) for step_id in ids)
    for i, ids in enumerate(shards):  # the limit counts the shard's own turns only
        assert len(pool.unjudged(1, (i, 3))) == 1 and set(pool.unjudged(1, (i, 3))) <= set(ids)

    assert pool.judge_failed("s0-0", "TimeoutError: the judge server", 2, 3600.0) is False
    sample = pool.show("s0-0")["sample"]
    assert (sample["judge_attempts"], sample["judge_error"], sample["judge_gave_up_at"]) == (
        1, "TimeoutError: the judge server", None)
    assert sample["judge_retry_at"] > time.time() + 3000 and "s0-0" not in pool.unjudged()  # backing off
    assert pool.judge_failed("s0-0", "ValueError: no score in the reply", 2, 3600.0) is True
    sample = pool.show("s0-0")["sample"]
    assert (sample["judge_attempts"], sample["judge_error"]) == (2, "ValueError: no score in the reply")
    assert sample["judge_gave_up_at"] is not None and sample["judge_retry_at"] is None
    assert "s0-0" not in pool.unjudged()

    assert pool.judge_failed("s1-0", "RuntimeError: once", 3, 60.0) is False
    assert "s1-0" not in pool.unjudged()
    pool_later(61)
    assert "s1-0" in pool.unjudged()  # its retry time came

    pool.add_reward(Reward(step_id="s0-0", score=1.0, source="feedback"))  # a give-up does not block feedback
    assert pool.show("s0-0")["sample"]["status"] == "ready"
    with pytest.raises(UnknownStepError):
        pool.judge_failed("nope", "x", 3, 1.0)
    with pytest.raises(ValueError):
        pool.unjudged(shard=(3, 3))


def _downgrade_to_v1(pool) -> None:
    """Turn a pool's database back into schema v1's: no judge columns, version 1."""
    from clawr1.datapool import SQLitePool

    if isinstance(pool, SQLitePool):
        conn, version = sqlite3.connect(pool.path, isolation_level=None), "PRAGMA user_version = 1"
    else:
        import psycopg

        conn = psycopg.connect(pool.dsn, autocommit=True)
        version = "UPDATE clawr1_meta SET value = '1' WHERE key = 'schema_version'"
    conn.execute("DROP INDEX samples_unjudged")
    for column in ("shard_key", "judge_attempts", "judge_error", "judge_retry_at", "judge_gave_up_at"):
        conn.execute(f"ALTER TABLE samples DROP COLUMN {column}")
    conn.execute(version)
    conn.close()


def test_a_pool_from_schema_v1_gets_the_judge_columns_and_its_turns_their_shards(open_test_pool):
    from clawr1.datapool.schema import shard_key

    old = open_test_pool()
    old.append_steps([make_step(f"s{i}-{t}", f"s{i}", t) for i in range(6) for t in range(2)])
    old.close()
    _downgrade_to_v1(old)
    pool = open_test_pool(like=old)
    shards = [pool.unjudged(shard=(i, 2)) for i in range(2)]
    assert sorted(sum(shards, [])) == sorted(f"s{i}-0" for i in range(6)) and all(shards)
    assert all(shard_key(step_id) % 2 == i for i, ids in enumerate(shards) for step_id in ids)
    assert pool.judge_failed("s0-0", "RuntimeError: x", 1, 1.0) is True
    assert pool.show("s0-0")["sample"]["judge_attempts"] == 1
    pool.append_step(make_step("s0-2", "s0", 2))  # new turns get their shard key at insert
    assert "s0-1" in pool.unjudged(shard=(shard_key("s0-1") % 2, 2))
