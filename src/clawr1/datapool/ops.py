"""The pool's write transactions, each a function of the writer's connection.

They run inside the writer's open transaction (see `writer.py`), so each may read then write
without races, and they never commit themselves. Arguments are already validated and encoded by
the caller's thread, which keeps the single writer thread busy with SQL only.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from clawr1.core import memory
from clawr1.core.records import Hint, Reward, SessionEvent
from clawr1.datapool.base import UnknownSessionError, UnknownStepError
from clawr1.datapool.schema import INSERT_STEP, STEP_COLUMNS, dumps, next_state_of, row_bytes, shard_key

# A batch of steps is stored with as few statements as SQLite's parameter limit allows, and what is
# derived from them (sessions, samples, next-state links) is maintained once per batch, set-based:
# a per-row trigger measured ~35 µs a step, mostly rewriting the same session row (and its two
# indexes) once per step and running three correlated statements per row. Few statements matter
# too: each execute hands the GIL back and forth, and callers encoding steps want it too (a
# multi-row INSERT measured ~1.6x faster than executemany, which steps once per row).
_ONE_ROW = "(" + ", ".join("?" * len(STEP_COLUMNS)) + ")"
_TENANT, _SESSION, _TURN, _TYPE, _VERSION, _CREATED = (STEP_COLUMNS.index(c) for c in (
    "tenant", "session_id", "turn_index", "turn_type", "policy_version", "created_at"))

# A step arriving for a closed session (a client that kept its session id) reopens it.
_UPSERT_SESSIONS = """INSERT INTO sessions (tenant, session_id, status, created_at, updated_at) VALUES {rows}
ON CONFLICT (tenant, session_id) DO UPDATE SET status = 'open', closed_at = NULL, updated_at =
CASE WHEN excluded.updated_at > sessions.updated_at THEN excluded.updated_at ELSE sessions.updated_at END"""
_ADD_USAGE = """INSERT INTO tenant_usage (tenant, bytes) VALUES {rows}
ON CONFLICT (tenant) DO UPDATE SET bytes = tenant_usage.bytes + excluded.bytes"""
_INSERT_SAMPLES = """INSERT INTO samples (step_id, tenant, session_id, turn_index, policy_version, next_step_id,
updated_at, shard_key, status, weight) VALUES {rows}"""
# A turn masked when its session closed without a next state (`close_session`) has one now that the
# session goes on: it waits for the judge again.
_RELINK = """WITH v(next_step_id, step_id) AS (VALUES {rows})
UPDATE samples SET next_step_id = v.next_step_id,
status = CASE WHEN status = 'dropped' AND reason = 'masked' THEN 'pending' ELSE status END,
reason = CASE WHEN status = 'dropped' AND reason = 'masked' THEN NULL ELSE reason END
FROM v WHERE samples.step_id = v.step_id"""
# The stored main turns of a session that can neighbour new ones with turns lo..hi: those in that
# range, and every one at the nearest turn index on each side of it. As one JSON row: each row
# fetched is a GIL round trip, and one costs up to a switch interval (5 ms) while callers encode.
_NEIGHBOURS = """WITH b(tenant, session_id, lo, hi) AS (VALUES {rows})
SELECT {columns}
FROM b JOIN samples s
ON s.tenant = b.tenant AND s.session_id = b.session_id AND s.turn_index
BETWEEN coalesce((SELECT max(p.turn_index) FROM samples p
                  WHERE p.tenant = b.tenant AND p.session_id = b.session_id AND p.turn_index < b.lo), b.lo)
    AND coalesce((SELECT min(n.turn_index) FROM samples n
                  WHERE n.tenant = b.tenant AND n.session_id = b.session_id AND n.turn_index > b.hi), b.hi)"""


def clock() -> float:
    """The pool's clock (wall time), read through this one name so that a test moves time by
    replacing it instead of sleeping."""
    return time.time()


def _with_rows(conn: sqlite3.Connection, sql: str, one_row: str, rows: list[tuple]) -> list[tuple]:
    """Run `sql`, its `{rows}` a VALUES list of `one_row` groups, over `rows` in as few statements
    as the parameter limit allows; returns the rows the statements return."""
    if not rows:
        return []
    per_statement = conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // len(rows[0])
    out: list[tuple] = []
    for start in range(0, len(rows), per_statement):
        chunk = rows[start:start + per_statement]
        query = sql.format(rows=", ".join([one_row] * len(chunk)))
        out += conn.execute(query, [value for row in chunk for value in row]).fetchall()
    return out


_COLUMNS = "s.tenant, s.session_id, s.turn_index, s.step_id, s.next_step_id"


def _neighbours(conn: sqlite3.Connection, bounds: list[tuple]) -> list[tuple]:
    """The stored neighbours of new turns (see `_NEIGHBOURS`); SQLite's come as one JSON row."""
    if not isinstance(conn, sqlite3.Connection):  # PostgreSQL: plain rows, fetched in bulk by the driver
        return [tuple(row) for row in _with_rows(conn, _NEIGHBOURS.replace("{columns}", _COLUMNS), "(?, ?, ?, ?)",
                                                  bounds)]
    query = _NEIGHBOURS.replace("{columns}", f"json_group_array(json_array({_COLUMNS}))")
    return [tuple(n) for (found,) in _with_rows(conn, query, "(?, ?, ?, ?)", bounds) for n in json.loads(found)]


def _link(conn: sqlite3.Connection, main: list[tuple]) -> tuple[dict[str, str | None], list[tuple]]:
    """Next-state links for new main turns `main` (step_id, tenant, session_id, turn_index, ...),
    computed before their samples are inserted so each is written once, with its link.

    Returns each new turn's next main turn (the lowest turn index above its own, the lowest step id
    among equals), and the (next_step_id, step_id) updates of stored turns that are the nearest
    main turn below a new one (every step of the highest turn index below it: each choice of an
    n > 1 request) and now have a nearer next turn.
    """
    sessions: dict[tuple[str, str], list[tuple]] = {}
    for step_id, tenant, session_id, turn, *_ in main:
        sessions.setdefault((tenant, session_id), []).append((turn, step_id, True, None))
    bounds = [(*key, min(t[0] for t in turns), max(t[0] for t in turns)) for key, turns in sessions.items()]
    for tenant, session_id, turn, step_id, next_id in _neighbours(conn, bounds):
        sessions[(tenant, session_id)].append((turn, step_id, False, next_id))
    links: dict[str, str | None] = {}
    updates = []
    for turns in sessions.values():
        turns.sort()
        # From the highest turn down: `following` is the first step of the next higher turn index,
        # `above_new` whether that turn has a new step (then each step of this turn precedes it).
        following, above_new, turn_new = None, False, False
        for i in range(len(turns) - 1, -1, -1):
            turn, step_id, new, next_id = turns[i]
            last_of_turn = i + 1 < len(turns) and turns[i + 1][0] != turn
            if last_of_turn:
                following, above_new, turn_new = turns[i + 1][1], turn_new, False
            if new:
                links[step_id] = following
            elif above_new and next_id != following:
                updates.append((following, step_id))
            turn_new = turn_new or new
    return links, updates


def insert_steps(conn: sqlite3.Connection, rows: list[tuple]) -> list[bool]:
    """Store steps once each (the step id is the idempotency key); True per newly stored row.

    A replay changes nothing: the first write stands. Each new step opens (or reopens) its
    session; new main turns become PENDING samples, linked to their neighbours (the next main
    turn holds a step's next state).
    """
    limit = conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    stored: set[str] = set()
    unique = list(dict.fromkeys(row[0] for row in rows))
    # A SELECT returning (nearly always) nothing beat INSERT ... ON CONFLICT DO NOTHING RETURNING:
    # RETURNING runs like a trigger, and each returned row is a GIL round trip.
    for start in range(0, len(unique), limit):
        chunk = unique[start:start + limit]
        query = f"SELECT step_id FROM steps WHERE step_id IN ({', '.join('?' * len(chunk))})"
        stored.update(step_id for (step_id,) in conn.execute(query, chunk).fetchall())
    fresh, results = [], []
    for row in rows:
        results.append(row[0] not in stored)
        if results[-1]:
            stored.add(row[0])  # a second copy within this batch is a replay too
            fresh.append(row)
    _with_rows(conn, f"{INSERT_STEP} {{rows}}", _ONE_ROW, fresh)
    sessions: dict[tuple[str, str], list[float]] = {}  # (tenant, session) -> [created_at, updated_at]
    for row in fresh:
        times = sessions.setdefault((row[_TENANT], row[_SESSION]), [row[_CREATED], row[_CREATED]])
        times[1] = max(times[1], row[_CREATED])
    _with_rows(conn, _UPSERT_SESSIONS, "(?, ?, 'open', ?, ?)", [(*key, *times) for key, times in sessions.items()])
    usage: dict[str, int] = {}
    for row in fresh:
        usage[row[_TENANT]] = usage.get(row[_TENANT], 0) + row_bytes(row)
    _with_rows(conn, _ADD_USAGE, "(?, ?)", list(usage.items()))
    main = [(row[0], row[_TENANT], row[_SESSION], row[_TURN], row[_VERSION], row[_CREATED])
            for row in fresh if row[_TYPE] == "main"]
    if main:
        links, updates = _link(conn, main)
        _with_rows(conn, _INSERT_SAMPLES, "(?, ?, ?, ?, ?, ?, ?, ?, 'pending', 1.0)",
                   [(*row[:5], links[row[0]], row[5], shard_key(row[0])) for row in main])
        _with_rows(conn, _RELINK, "(?, ?)", updates)
    return results


def _require_step(conn: sqlite3.Connection, step_id: str) -> None:
    if conn.execute("SELECT 1 FROM steps WHERE step_id = ?", (step_id,)).fetchone() is None:
        raise UnknownStepError(step_id)


EXPLICIT_SOURCES = ("feedback", "outcome")
STEPWISE = "stepwise"  # an intermediate turn's judge score mixed with its session's outcome
# Who a reward must not override (it is then kept as history only). What a person said (feedback)
# is never overridden; the environment's word (a session's outcome, or the step-wise mix of judge
# and outcome) is never overridden by a judge's later opinion. Among equals the latest wins.
_OUTRANKED_BY = {"feedback": (), "outcome": (), STEPWISE: ("feedback",)}
_JUDGE_OUTRANKED_BY = (*EXPLICIT_SOURCES, STEPWISE)


def _outranked(conn: sqlite3.Connection, reward: Reward) -> bool:
    above = _OUTRANKED_BY.get(reward.source, _JUDGE_OUTRANKED_BY)
    return bool(above) and conn.execute(
        f"SELECT 1 FROM rewards WHERE step_id = ? AND source IN ({', '.join('?' * len(above))}) LIMIT 1",
        (reward.step_id, *above)).fetchone() is not None


def add_reward(conn: sqlite3.Connection, reward: Reward) -> None:
    _require_step(conn, reward.step_id)
    conn.execute("INSERT INTO rewards (step_id, score, source, votes, evidence, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                 (reward.step_id, reward.score, reward.source, dumps(reward.votes), reward.evidence, reward.created_at))
    # The latest reward wins while the sample waits; once leased or later, it is history only
    # (until an expired lease hands the sample back: `expire_leases`).
    if _outranked(conn, reward):
        return
    _apply(conn, reward.step_id, reward.score)
    if reward.source not in _OUTRANKED_BY:
        _mix_if_closed(conn, reward)


def _apply(conn: sqlite3.Connection, step_id: str, score: float) -> None:
    """Make `score` a waiting sample's reward: non-zero is trainable (ready, keeping its place in
    line); zero is not, unless a hint makes it a distillation sample."""
    now = clock()
    if score != 0:
        conn.execute("UPDATE samples SET reward = ?, updated_at = ?, status = 'ready', "
                     "ready_at = CASE WHEN status = 'ready' THEN ready_at ELSE ? END "  # keeps its place in line
                     "WHERE step_id = ? AND status IN ('pending', 'ready')", (score, now, now, step_id))
    elif conn.execute("SELECT 1 FROM hints WHERE step_id = ? LIMIT 1", (step_id,)).fetchone() is not None:
        conn.execute("UPDATE samples SET reward = 0, updated_at = ?, status = 'ready', ready_at = coalesce(ready_at, ?) "
                     "WHERE step_id = ? AND status IN ('pending', 'ready')", (now, now, step_id))
    else:
        conn.execute("UPDATE samples SET reward = 0, updated_at = ?, status = 'pending', ready_at = NULL "
                     "WHERE step_id = ? AND status IN ('pending', 'ready')", (now, step_id))


def _effective_score(conn: sqlite3.Connection, step_id: str) -> float | None:
    """The reward `add_reward` would have left on a waiting sample, from its rewards in the order
    they came: the latest one that nothing before it outranked."""
    score, seen = None, set()
    for value, source in conn.execute("SELECT score, source FROM rewards WHERE step_id = ? ORDER BY id", (step_id,)):
        if not seen.intersection(_OUTRANKED_BY.get(source, _JUDGE_OUTRANKED_BY)):
            score = value
        seen.add(source)
    return score


def _stepwise(step_id: str, judge: float, judge_source: str, outcome: float, weight: float) -> Reward:
    """An intermediate turn's final reward, (1 - w) * judge + w * outcome, with its parts as evidence
    (so `clawr1 pool show STEP` explains the number)."""
    score = max(-1.0, min(1.0, (1.0 - weight) * judge + weight * outcome))  # float rounding only
    evidence = {"formula": "(1 - step_weight) * judge + step_weight * outcome", "judge": judge,
                "judge_source": judge_source, "outcome": outcome, "step_weight": weight}
    return Reward(step_id=step_id, score=score, source=STEPWISE, evidence=dumps(evidence))


def _close_weight(conn: sqlite3.Connection, tenant: str, session_id: str) -> float:
    """The step weight the session's latest close used (0 when it named none)."""
    row = conn.execute("SELECT data FROM events WHERE tenant = ? AND session_id = ? AND kind = 'close' "
                       "ORDER BY id DESC LIMIT 1", (tenant, session_id)).fetchone()
    return 0.0 if row is None else float(json.loads(row[0]).get("step_weight") or 0.0)


def _mix_if_closed(conn: sqlite3.Connection, judged: Reward) -> None:
    """A judge score that arrives after its session closed with an outcome (the close came first):
    an intermediate turn then gets the step-wise mix, as if the judge had been first."""
    row = conn.execute(
        "SELECT s.tenant, s.session_id, s.turn_index, x.status, x.outcome_reward, "
        "(SELECT max(l.turn_index) FROM samples l WHERE l.tenant = s.tenant AND l.session_id = s.session_id) "
        "FROM samples s JOIN sessions x ON x.tenant = s.tenant AND x.session_id = s.session_id "
        "WHERE s.step_id = ?", (judged.step_id,)).fetchone()
    if row is None:
        return  # a side turn: no sample
    tenant, session_id, turn, status, outcome, last = row
    if status != "closed" or outcome is None or turn >= last:
        return
    weight = _close_weight(conn, tenant, session_id)
    if weight > 0:
        add_reward(conn, _stepwise(judged.step_id, judged.score, judged.source, outcome, weight))


def _mix_on_close(conn: sqlite3.Connection, tenant: str, session_id: str, last_turn: int, outcome: float,
                  weight: float) -> None:
    """The session closes after (some of) its intermediate turns were judged: each gets the
    step-wise mix of its latest judge score; turns with explicit feedback keep it."""
    latest: dict[str, tuple[float, str]] = {}
    felt: set[str] = set()
    for step_id, score, source in conn.execute(
            "SELECT r.step_id, r.score, r.source FROM samples s JOIN rewards r ON r.step_id = s.step_id "
            "WHERE s.tenant = ? AND s.session_id = ? AND s.turn_index < ? ORDER BY r.id",
            (tenant, session_id, last_turn)):
        if source == "feedback":
            felt.add(step_id)
        elif source not in _OUTRANKED_BY:
            latest[step_id] = (score, source)
    for step_id, (score, source) in latest.items():
        if step_id not in felt:
            add_reward(conn, _stepwise(step_id, score, source, outcome, weight))


def add_hint(conn: sqlite3.Connection, hint: Hint) -> None:
    _require_step(conn, hint.step_id)
    conn.execute("INSERT INTO hints (step_id, text, source, created_at) VALUES (?, ?, ?, ?)",
                 (hint.step_id, hint.text, hint.source, hint.created_at))
    remember(conn, hint)


def add_judgement(conn: sqlite3.Connection, reward: Reward, hint: Hint | None) -> None:
    add_reward(conn, reward)
    if hint is not None:
        add_hint(conn, hint)
        if reward.score == 0:  # no reward, but a hint: still a distillation sample
            mark_ready(conn, reward.step_id)


def mark_ready(conn: sqlite3.Connection, step_id: str, unmask: bool = False) -> bool:
    """A waiting sample becomes trainable; `unmask`: one masked at its session's close too (a
    correction for the last turn gives it what the mask said it lacked)."""
    _require_step(conn, step_id)
    now = clock()
    masked = " OR (status = 'dropped' AND reason = 'masked')" if unmask else ""
    return conn.execute("UPDATE samples SET status = 'ready', ready_at = ?, updated_at = ?, "
                        "reason = CASE WHEN status = 'dropped' THEN NULL ELSE reason END "
                        f"WHERE step_id = ? AND (status = 'pending'{masked})", (now, now, step_id)).rowcount == 1


def judge_failed(conn: sqlite3.Connection, step_id: str, error: str, max_attempts: int, retry_s: float) -> bool:
    """Count a failed judging attempt and keep its error; the turn waits `retry_s * 2**(attempts-1)`
    before the next one, and after `max_attempts` the judge gives up on it (`judge_gave_up_at`, the
    last error its reason): it leaves `unjudged()` for good. True if this attempt gave up."""
    row = conn.execute("SELECT judge_attempts FROM samples WHERE step_id = ?", (step_id,)).fetchone()
    if row is None:
        raise UnknownStepError(step_id)
    attempts, now = row[0] + 1, clock()
    gave_up = attempts >= max_attempts
    conn.execute("UPDATE samples SET judge_attempts = ?, judge_error = ?, judge_retry_at = ?, judge_gave_up_at = ?, "
                 "updated_at = ? WHERE step_id = ?",
                 (attempts, error, None if gave_up else now + retry_s * 2 ** (attempts - 1), now if gave_up else None,
                  now, step_id))
    return gave_up


def _insert_event(conn: sqlite3.Connection, event: SessionEvent) -> None:
    conn.execute("INSERT INTO events (tenant, session_id, kind, data, created_at) VALUES (?, ?, ?, ?, ?)",
                 (event.tenant, event.session_id, event.kind, dumps(event.data), event.created_at))


def close_session(conn: sqlite3.Connection, tenant: str, session_id: str, outcome: float | None, reason: str,
                  step_weight: float = 0.0) -> bool:
    key = (tenant, session_id)
    row = conn.execute("SELECT status FROM sessions WHERE tenant = ? AND session_id = ?", key).fetchone()
    if row is None:
        raise UnknownSessionError(f"{tenant}/{session_id}")
    if row[0] == "closed":
        return False
    now = clock()
    conn.execute("UPDATE sessions SET status = 'closed', closed_at = ?, updated_at = ?, outcome_reward = ? "
                 "WHERE tenant = ? AND session_id = ?", (now, now, outcome, *key))
    data: dict[str, object] = {"reason": reason, "outcome_reward": outcome}
    if outcome is not None:
        data["step_weight"] = step_weight  # a judge score arriving later mixes with the same weight
    _insert_event(conn, SessionEvent(session_id, "close", tenant, data, now))
    # The last main turn: every step at its index (each choice of an n > 1 request).
    last = conn.execute("SELECT step_id, turn_index FROM samples WHERE tenant = ? AND session_id = ? AND turn_index = "
                        "(SELECT max(turn_index) FROM samples WHERE tenant = ? AND session_id = ?) ORDER BY step_id",
                        (*key, *key)).fetchall()
    if not last:
        return True
    if outcome is not None:
        for step_id, _ in last:
            add_reward(conn, Reward(step_id=step_id, score=outcome, source="outcome", evidence=f"session {reason}"))
        if step_weight > 0:
            _mix_on_close(conn, tenant, session_id, last[0][1], outcome, step_weight)
        return True
    for step_id, _ in last:
        if conn.execute("UPDATE samples SET status = 'dropped', reason = 'masked', updated_at = ? "
                        "WHERE step_id = ? AND status = 'pending' AND reward IS NULL", (now, step_id)).rowcount:
            # No next state to judge it by and no outcome: mask it, say so (a step that comes
            # later in this session unmasks it: `_RELINK`).
            why = {"step_id": step_id, "why": "no next state, no outcome"}
            _insert_event(conn, SessionEvent(session_id, "mask", tenant, why, now))
    return True


def open_session(conn: sqlite3.Connection, tenant: str, session_id: str, key_hash: str | None) -> bool:
    """Create a session before its first step (e.g. one with its own API key); False if it existed."""
    now = clock()
    created = conn.execute("INSERT INTO sessions (tenant, session_id, status, created_at, updated_at, key_hash) "
                           "VALUES (?, ?, 'open', ?, ?, ?) ON CONFLICT DO NOTHING",
                           (tenant, session_id, now, now, key_hash)).rowcount == 1
    if created:
        _insert_event(conn, SessionEvent(session_id, "open", tenant, {"with_key": key_hash is not None}, now))
    return created


def close_idle(conn: sqlite3.Connection, idle_before: float, keep: set[tuple[str, str]],
               mine: Callable[[str], bool] | None = None) -> list[tuple[str, str]]:
    """Close every open session with no activity since `idle_before`, except those in `keep` and,
    given `mine`, those it refuses; returns the (tenant, session_id)s closed."""
    idle = [tuple(row) for row in conn.execute("SELECT tenant, session_id FROM sessions WHERE status = 'open' "
                                               "AND updated_at < ?", (idle_before,))
            if tuple(row) not in keep and (mine is None or mine(row[1]))]
    for tenant, session_id in idle:
        close_session(conn, tenant, session_id, None, "idle")
    return idle


def feedback_steps(conn: sqlite3.Connection, tenant: str, session_id: str | None, turn_index: int | None,
                   completion_id: str | None) -> list[str]:
    """The step ids feedback is about: a completion's choices, a session's given turn, or the
    session's latest main turn."""
    if completion_id is not None:
        # Its choices are `<id>-0`, `<id>-1`, ...: a key range ('.' sorts right after '-') uses the index.
        rows = conn.execute("SELECT step_id FROM steps WHERE step_id > ? AND step_id < ? AND tenant = ? "
                            "ORDER BY step_id", (completion_id + "-", completion_id + ".", tenant)).fetchall()
        # Exactly `<id>-<choice>`: a shorter id ("chatcmpl") would otherwise name every reply under it.
        choices = [r[0] for r in rows if r[0][len(completion_id) + 1:].isdigit()]
        if not choices:
            raise UnknownStepError(completion_id)
        return choices
    key = (tenant, session_id)
    if conn.execute("SELECT 1 FROM sessions WHERE tenant = ? AND session_id = ?", key).fetchone() is None:
        raise UnknownSessionError(f"{tenant}/{session_id}")
    if turn_index is None:
        turn = conn.execute("SELECT max(turn_index) FROM steps WHERE tenant = ? AND session_id = ? "
                            "AND turn_type = 'main'", key).fetchone()[0]
    else:
        turn = turn_index
    rows = conn.execute("SELECT step_id FROM steps WHERE tenant = ? AND session_id = ? AND turn_index = ? "
                        "ORDER BY step_id", (*key, turn)).fetchall()
    if not rows:
        raise UnknownStepError(f"{tenant}/{session_id} turn {turn_index if turn_index is not None else '(latest)'}")
    return [r[0] for r in rows]


def add_feedback(conn: sqlite3.Connection, tenant: str, session_id: str | None, turn_index: int | None,
                 completion_id: str | None, score: float | None, correction: str | None) -> list[str]:
    """Explicit feedback: a reward (source `feedback`) and/or a hint for each step it names."""
    step_ids = feedback_steps(conn, tenant, session_id, turn_index, completion_id)
    now = clock()
    for step_id in step_ids:
        if score is not None:
            add_reward(conn, Reward(step_id=step_id, score=score, source="feedback", evidence=correction or "",
                                    created_at=now))
        if correction:
            add_hint(conn, Hint(step_id=step_id, text=correction, source="feedback", created_at=now))
            if not score:  # no reward (or zero), but a correction: a distillation sample, as the judge's
                mark_ready(conn, step_id, unmask=True)
    return step_ids


def hold_out(conn: sqlite3.Connection, tenant: str | None, n: int) -> list[str]:
    """Up to `n` recent main turns (of `tenant`, or any) that nothing trained on yet (PENDING or
    READY), one per session while there are enough sessions, each session's earliest such turn
    first, dropped from training with reason `probe`: the guard's held-out requests. Early turns
    carry their own topic; a late one is often only a reaction ("Shorter, please"), against which
    the relevance measure cannot tell an answer from a non-answer (on the demo's traffic the base
    model's replies to such probes were judged sane 0.25-0.83 of the time, to first turns ~0.9)."""
    rows = conn.execute(
        "SELECT step_id, session_id, turn_index FROM samples WHERE tenant = coalesce(?, tenant) "
        "AND status IN ('pending', 'ready') ORDER BY updated_at DESC LIMIT ?", (tenant, n * 8)).fetchall()
    earliest: dict[str, tuple[str, int]] = {}  # session -> its earliest candidate turn (sessions newest first)
    for step_id, session_id, turn in rows:
        if session_id not in earliest or turn < earliest[session_id][1]:
            earliest[session_id] = (step_id, turn)
    chosen = [step_id for step_id, _ in sorted(earliest.values(), key=lambda v: v[1])][:n]  # stable: recency
    chosen += [step_id for step_id, _, _ in rows if step_id not in chosen][: n - len(chosen)]
    now = clock()
    for step_id in chosen:
        conn.execute("UPDATE samples SET status = 'dropped', reason = 'probe', updated_at = ? WHERE step_id = ?",
                     (now, step_id))
    return chosen


def record_version(conn: sqlite3.Connection, adapter: str, version: int, status: str, reason: str,
                   scores: dict[str, Any]) -> None:
    conn.execute("INSERT INTO policy_versions (adapter, version, status, reason, scores, decided_at) "
                 "VALUES (?, ?, ?, ?, ?, ?)", (adapter, version, status, reason, json.dumps(scores), clock()))


# ---- per-user memory (`clawr1/core/memory.py`) ------------------------------------------------

def _rev(conn: sqlite3.Connection, table: str) -> int:
    """The next change number of a memory table (one per transaction: every row it changes gets it)."""
    return conn.execute(f"SELECT coalesce(max(rev), 0) + 1 FROM {table}").fetchone()[0]


def _switched_off(conn: sqlite3.Connection, tenant: str, user: str) -> bool:
    return conn.execute("SELECT 1 FROM memory_switches WHERE tenant = ? AND user_id IN ('', ?) AND off = 1 LIMIT 1",
                        (tenant, user)).fetchone() is not None


def _correction(conn: sqlite3.Connection, step_id: str) -> str | None:
    """What the user said after a step (its next state's user text): the correction its hint came from."""
    row = conn.execute("SELECT n.messages FROM samples s JOIN steps n ON n.step_id = s.next_step_id "
                       "WHERE s.step_id = ?", (step_id,)).fetchone()
    said = []
    for message in next_state_of(json.loads(row[0])) if row else []:
        content = message.get("content")
        if message.get("role") == "user":
            said.append(content if isinstance(content, str) else "".join(
                str(p.get("text", "")) for p in content or [] if isinstance(p, dict)))
    return " ".join(said)[: memory.MAX_CORRECTION_CHARS] or None


def remember(conn: sqlite3.Connection, hint: Hint) -> int | None:
    """A hint from a correction becomes a memory entry of the user whose turn it corrects (the one
    the step's memory record names; a step without one named no user, or had the memory off), unless
    the memory is switched off for them. A repeat of an active entry is not stored again; a newer
    entry replaces the active ones on its topic; past `MAX_ACTIVE` the oldest are evicted. Bad input
    is kept as `refused`, with why, and never reaches a prompt. Returns the new entry's id."""
    if hint.source != "feedback" and hint.text.startswith(memory.TOOL_HINT_PREFIX):
        return None  # one tool call's error, not the user's
    row = conn.execute("SELECT tenant, session_id, memory FROM steps WHERE step_id = ?", (hint.step_id,)).fetchone()
    user = None if row is None or row[2] is None else json.loads(row[2]).get("user")
    if not user:
        return None
    tenant, session_id = row[0], row[1]
    if _switched_off(conn, tenant, user):
        return None
    correction = hint.text if hint.source == "feedback" else _correction(conn, hint.step_id)
    if not correction:
        # The judge reads the whole next state, tool results included: a hint from a turn the user
        # said nothing in would carry a tool's output (a fetched page, a file) into the user's
        # system prompt for good. Only what the user (or explicit feedback) said becomes memory.
        return None
    text = memory.fold(hint.text)
    why = memory.refusal(text)
    active = conn.execute("SELECT id, text, topic FROM memory_entries WHERE tenant = ? AND user_id = ? "
                          "AND status = 'active' ORDER BY created_at, id", (tenant, user)).fetchall()
    # A retired entry on the new one's topic is replaced too: the user corrected it again, so the
    # weights did not hold it, and the newer wording wins.
    topic = memory.topic(text) if why is None else "refused"
    retired = conn.execute("SELECT id FROM memory_entries WHERE tenant = ? AND user_id = ? AND status = 'retired' "
                           "AND topic = ?", (tenant, user, topic)).fetchall() if why is None else []
    if why is None and any(memory.normal(t) == memory.normal(text) for _, t, _ in active):
        return None  # a repeat (say, feedback on each of a completion's choices): the first stands
    now, rev = clock(), _rev(conn, "memory_entries")
    stored, said = text[: 4 * memory.MAX_ENTRY_CHARS], correction[: memory.MAX_CORRECTION_CHARS]
    entry = conn.execute(
        "INSERT INTO memory_entries (tenant, user_id, text, topic, status, reason, source, step_id, session_id, "
        "correction, created_at, updated_at, rev) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
        (tenant, user, stored, topic, "refused" if why else "active", why, hint.source, hint.step_id, session_id,
         said, now, now, rev)).fetchone()[0]
    _with_rows(conn, _ADD_USAGE, "(?, ?)", [(tenant, len(stored) + len(said))])  # on the quota, as steps are
    if why is not None:
        return entry
    replaced = [i for i, _, t in active if t == topic] + [r[0] for r in retired]
    kept = [i for i, _, t in active if t != topic]
    evicted = kept[: max(0, len(kept) + 1 - memory.MAX_ACTIVE)]  # oldest first
    for ids, status, by in ((replaced, "replaced", entry), (evicted, "evicted", None)):
        if ids:
            conn.execute(f"UPDATE memory_entries SET status = ?, replaced_by = ?, updated_at = ?, rev = ? "
                         f"WHERE id IN ({', '.join('?' * len(ids))})", (status, by, now, rev, *ids))
    return entry


def forget_memory(conn: sqlite3.Connection, entry_id: int | None, tenant: str | None, user: str | None) -> list[int]:
    """Forget one entry (by id, within `tenant` when given), or every active entry of a user of a
    tenant: it leaves the prompts at the gateways' next read. Returns the ids forgotten (an entry
    already forgotten is not counted again)."""
    if entry_id is not None:
        rows = conn.execute("SELECT id FROM memory_entries WHERE id = ? AND tenant = coalesce(?, tenant) "
                            "AND status IN ('active', 'replaced', 'evicted', 'refused')", (entry_id, tenant)).fetchall()
    else:
        rows = conn.execute("SELECT id FROM memory_entries WHERE tenant = ? AND user_id = ? AND status = 'active'",
                            (tenant, user)).fetchall()
    ids = [r[0] for r in rows]
    if ids:
        conn.execute(f"UPDATE memory_entries SET status = 'forgotten', updated_at = ?, rev = ? "
                     f"WHERE id IN ({', '.join('?' * len(ids))})", (clock(), _rev(conn, "memory_entries"), *ids))
    return ids


def check_memory(conn: sqlite3.Connection, version: int, gaps: dict[int, dict[str, Any]], retire_gap: float,
                 return_gap: float, min_tokens: int, retire: bool = True, source: str = "trained") -> dict[str, list[int]]:
    """Record each entry's consolidation measure on `version` (`gaps`: entry id -> `gap`, nats a token,
    `tokens`, `steps`; `source`: where measured) and act on it: an active entry measured on at least
    `min_tokens` with a gap at most `retire_gap` either way retires if `retire` (leaves the prompts;
    its newest steps kept to measure it again on); a retired one whose gap grew past `return_gap` is
    active again. Returns the ids `retired` and `restored`."""
    out: dict[str, list[int]] = {"retired": [], "restored": []}
    if not gaps:
        return out
    now, rev = clock(), _rev(conn, "memory_entries")
    for entry_id, measured in gaps.items():
        row = conn.execute("SELECT status, checks, retired_on FROM memory_entries WHERE id = ?", (entry_id,)).fetchone()
        if row is None or row[0] not in ("active", "retired"):
            continue  # forgotten, replaced or evicted while the version trained: nothing to decide
        gap, tokens = float(measured["gap"]), int(measured["tokens"])
        checks = [*json.loads(row[1] or "[]"), {"version": version, "gap": round(gap, 4), "tokens": tokens,
                                                "source": source}]
        status, retired_on = row[0], row[2]
        # Either sign is a difference: negative, the version unreminded says these replies more
        # readily than the reminded teacher (over-learned, or replies the memory did not shape).
        if retire and status == "active" and tokens >= min_tokens and abs(gap) <= retire_gap:
            status = "retired"
            retired_on = dumps(list(measured.get("steps", ()))[-memory.RECHECK_STEPS:])
            out["retired"].append(entry_id)
        elif status == "retired" and abs(gap) > return_gap:
            status = "active"
            out["restored"].append(entry_id)
        conn.execute("UPDATE memory_entries SET status = ?, gap = ?, checked_version = ?, checks = ?, retired_on = ?, "
                     "updated_at = ?, rev = CASE WHEN status = ? THEN rev ELSE ? END WHERE id = ?",
                     (status, gap, version, dumps(checks[-memory.MAX_CHECKS:]), retired_on, now, status, rev,
                      entry_id))
    return out


def switch_memory(conn: sqlite3.Connection, tenant: str, user: str, off: bool) -> bool:
    """Turn the memory off (or on again) for a user of a tenant, or (`user` '') the whole tenant.
    True if that changed anything."""
    row = conn.execute("SELECT off FROM memory_switches WHERE tenant = ? AND user_id = ?", (tenant, user)).fetchone()
    if (row[0] if row else 0) == int(off):
        return False
    conn.execute("INSERT INTO memory_switches (tenant, user_id, off, updated_at, rev) VALUES (?, ?, ?, ?, ?) "
                 "ON CONFLICT (tenant, user_id) DO UPDATE SET off = excluded.off, updated_at = excluded.updated_at, "
                 "rev = excluded.rev", (tenant, user, int(off), clock(), _rev(conn, "memory_switches")))
    return True
