"""The pool's write transactions, each a function of the writer's connection.

They run inside the writer's open transaction (see `writer.py`), so each may read then write
without races, and they never commit themselves. Arguments are already validated and encoded by
the caller's thread, which keeps the single writer thread busy with SQL only.
"""

from __future__ import annotations

import sqlite3
import time

from clawr1.core.config import PoolConfig
from clawr1.core.records import Hint, Lease, Reward, Sample, SessionEvent
from clawr1.datapool.base import UnknownLeaseError, UnknownSessionError, UnknownStepError
from clawr1.datapool.schema import INSERT_STEP, STEP_COLUMNS, dumps

# A batch of steps is stored with as few statements as SQLite's parameter limit allows (the
# `step_stored` trigger does the rest in the same statement). Each execute hands the GIL back and
# forth, and callers encoding steps want it too: a multi-row INSERT measured ~1.6x faster than
# executemany, which steps once per row.
_ONE_ROW = "(" + ", ".join("?" * len(STEP_COLUMNS)) + ")"


def insert_steps(conn: sqlite3.Connection, rows: list[tuple]) -> list[bool]:
    """Store steps once each (the step id is the idempotency key); True per newly stored row.

    A replay changes nothing: the first write stands. New main turns become PENDING samples and
    are linked to their neighbours (the next main turn holds a step's next state).
    """
    limit = conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    stored: set[str] = set()
    unique = list(dict.fromkeys(row[0] for row in rows))
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
    per_statement = limit // len(STEP_COLUMNS)
    for start in range(0, len(fresh), per_statement):
        chunk = fresh[start:start + per_statement]
        conn.execute(f"{INSERT_STEP} {', '.join([_ONE_ROW] * len(chunk))}", [value for row in chunk for value in row])
    return results


def _require_step(conn: sqlite3.Connection, step_id: str) -> None:
    if conn.execute("SELECT 1 FROM steps WHERE step_id = ?", (step_id,)).fetchone() is None:
        raise UnknownStepError(step_id)


def add_reward(conn: sqlite3.Connection, reward: Reward) -> None:
    _require_step(conn, reward.step_id)
    conn.execute("INSERT INTO rewards (step_id, score, source, votes, evidence, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                 (reward.step_id, reward.score, reward.source, dumps(reward.votes), reward.evidence, reward.created_at))
    # The latest reward wins while the sample waits; once leased or later, it is history only.
    now = time.time()
    if reward.score != 0:
        conn.execute("UPDATE samples SET reward = ?, updated_at = ?, status = 'ready', "
                     "ready_at = CASE WHEN status = 'ready' THEN ready_at ELSE ? END "  # keeps its place in line
                     "WHERE step_id = ? AND status IN ('pending', 'ready')", (reward.score, now, now, reward.step_id))
    else:
        conn.execute("UPDATE samples SET reward = 0, updated_at = ?, status = 'pending', ready_at = NULL "
                     "WHERE step_id = ? AND status IN ('pending', 'ready')", (now, reward.step_id))


def add_hint(conn: sqlite3.Connection, hint: Hint) -> None:
    _require_step(conn, hint.step_id)
    conn.execute("INSERT INTO hints (step_id, text, source, created_at) VALUES (?, ?, ?, ?)",
                 (hint.step_id, hint.text, hint.source, hint.created_at))


def mark_ready(conn: sqlite3.Connection, step_id: str) -> bool:
    _require_step(conn, step_id)
    now = time.time()
    return conn.execute("UPDATE samples SET status = 'ready', ready_at = ?, updated_at = ? "
                        "WHERE step_id = ? AND status = 'pending'", (now, now, step_id)).rowcount == 1


def _insert_event(conn: sqlite3.Connection, event: SessionEvent) -> None:
    conn.execute("INSERT INTO events (tenant, session_id, kind, data, created_at) VALUES (?, ?, ?, ?, ?)",
                 (event.tenant, event.session_id, event.kind, dumps(event.data), event.created_at))


def close_session(conn: sqlite3.Connection, tenant: str, session_id: str, outcome: float | None, reason: str) -> bool:
    key = (tenant, session_id)
    row = conn.execute("SELECT status FROM sessions WHERE tenant = ? AND session_id = ?", key).fetchone()
    if row is None:
        raise UnknownSessionError(f"{tenant}/{session_id}")
    if row[0] == "closed":
        return False
    now = time.time()
    conn.execute("UPDATE sessions SET status = 'closed', closed_at = ?, updated_at = ?, outcome_reward = ? "
                 "WHERE tenant = ? AND session_id = ?", (now, now, outcome, *key))
    _insert_event(conn, SessionEvent(session_id, "close", tenant, {"reason": reason, "outcome_reward": outcome}, now))
    last = conn.execute("SELECT step_id FROM samples WHERE tenant = ? AND session_id = ? "  # main turns only
                        "ORDER BY turn_index DESC LIMIT 1", key).fetchone()
    if last is None:
        return True
    if outcome is not None:
        add_reward(conn, Reward(step_id=last[0], score=outcome, source="outcome", evidence=f"session {reason}"))
    elif conn.execute("UPDATE samples SET status = 'dropped', reason = 'masked', updated_at = ? "
                      "WHERE step_id = ? AND status = 'pending' AND reward IS NULL", (now, last[0])).rowcount:
        # The last turn has no next state to judge it by and no outcome: mask it, say so.
        why = {"step_id": last[0], "why": "no next state, no outcome"}
        _insert_event(conn, SessionEvent(session_id, "mask", tenant, why, now))
    return True


def open_session(conn: sqlite3.Connection, tenant: str, session_id: str, key_hash: str | None) -> bool:
    """Create a session before its first step (e.g. one with its own API key); False if it existed."""
    now = time.time()
    created = conn.execute("INSERT INTO sessions (tenant, session_id, status, created_at, updated_at, key_hash) "
                           "VALUES (?, ?, 'open', ?, ?, ?) ON CONFLICT DO NOTHING",
                           (tenant, session_id, now, now, key_hash)).rowcount == 1
    if created:
        _insert_event(conn, SessionEvent(session_id, "open", tenant, {"with_key": key_hash is not None}, now))
    return created


def close_idle(conn: sqlite3.Connection, idle_before: float, keep: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """Close every open session with no activity since `idle_before`, except those in `keep`;
    returns the (tenant, session_id)s closed."""
    idle = [tuple(row) for row in conn.execute("SELECT tenant, session_id FROM sessions WHERE status = 'open' "
                                               "AND updated_at < ?", (idle_before,)) if tuple(row) not in keep]
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
        if not rows:
            raise UnknownStepError(completion_id)
        return [r[0] for r in rows]
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
    now = time.time()
    for step_id in step_ids:
        if score is not None:
            add_reward(conn, Reward(step_id=step_id, score=score, source="feedback", evidence=correction or "",
                                    created_at=now))
        if correction:
            add_hint(conn, Hint(step_id=step_id, text=correction, source="feedback", created_at=now))
    return step_ids


def expire_leases(conn: sqlite3.Connection, now: float) -> int:
    """Expired leases' samples go back to READY; they keep the lease id so a late ack still
    consumes the ones nobody leased again."""
    expired = "SELECT lease_id FROM leases WHERE state = 'open' AND expires_at <= ?1"
    returned = conn.execute("UPDATE samples SET status = 'ready', updated_at = ?1 "
                            f"WHERE status = 'leased' AND lease_id IN ({expired})", (now,)).rowcount
    conn.execute(f"UPDATE leases SET state = 'expired', closed_at = ?1 WHERE lease_id IN ({expired})", (now,))
    return returned


_PICK = """SELECT step_id, policy_version, weight, reward, reason FROM samples
WHERE status = 'ready' AND policy_version {cmp} ? ORDER BY policy_version DESC, ready_at LIMIT ?"""


def lease(conn: sqlite3.Connection, lease_id: str, n: int, max_staleness: int, current_version: int,
          config: PoolConfig) -> Lease:
    now = time.time()
    expire_leases(conn, now)
    floor = current_version - max_staleness
    if config.stale_policy == "drop":
        conn.execute("UPDATE samples SET status = 'dropped', reason = 'stale', updated_at = ? "
                     "WHERE status = 'ready' AND policy_version < ?", (now, floor))
    else:
        conn.execute("UPDATE samples SET weight = ?, reason = 'stale', updated_at = ? "
                     "WHERE status = 'ready' AND policy_version < ? AND reason IS NOT 'stale'",
                     (config.stale_weight, now, floor))
    fresh = conn.execute(_PICK.format(cmp=">="), (current_version, n)).fetchall()
    older = conn.execute(_PICK.format(cmp="<"), (current_version, n)).fetchall()
    # Aim for the configured share of fresh samples; either kind fills in when the other is short.
    take_fresh = min(len(fresh), max(round(n * config.fresh_fraction), n - len(older)))
    chosen = fresh[:take_fresh] + older[:n - take_fresh]
    if not chosen:
        return Lease(lease_id=lease_id, step_ids=(), expires_at=now + config.lease_seconds)
    expires_at = now + config.lease_seconds
    conn.executemany("UPDATE samples SET status = 'leased', lease_id = ?, updated_at = ? WHERE step_id = ?",
                     [(lease_id, now, row[0]) for row in chosen])
    conn.execute("INSERT INTO leases (lease_id, state, n, created_at, expires_at) VALUES (?, 'open', ?, ?, ?)",
                 (lease_id, len(chosen), now, expires_at))
    samples = tuple(Sample(step_id=r[0], policy_version=r[1], status="leased", weight=r[2], reward=r[3], reason=r[4])
                    for r in chosen)
    return Lease(lease_id=lease_id, step_ids=tuple(s.step_id for s in samples), expires_at=expires_at, samples=samples)


def ack(conn: sqlite3.Connection, lease_id: str) -> int:
    now = time.time()
    expire_leases(conn, now)
    row = conn.execute("SELECT state FROM leases WHERE lease_id = ?", (lease_id,)).fetchone()
    if row is None:
        raise UnknownLeaseError(lease_id)
    if row[0] == "acked":
        return 0  # a double ack is harmless
    consumed = conn.execute("UPDATE samples SET status = 'consumed', updated_at = ? WHERE lease_id = ? "
                            "AND status IN ('leased', 'ready')", (now, lease_id)).rowcount
    conn.execute("UPDATE leases SET state = 'acked', closed_at = ? WHERE lease_id = ?", (now, lease_id))
    return consumed
