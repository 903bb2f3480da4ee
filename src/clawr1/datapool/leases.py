"""The training queue's write transactions (functions of the writer's connection, as `ops.py`'s):
lease, acknowledge, give back, expire, and the count of failed training attempts that drops a
sample the trainer cannot train (`poison`) instead of leasing it to its death forever.

Each failed attempt (an expired lease, or one the trainer gave back with why) is an event of the
sample's session, the pool's append-only log: `clawr1 pool show` lists them with their errors, and
the count needs no column of its own.
"""

from __future__ import annotations

import json
import logging
import sqlite3

from clawr1.core.config import PoolConfig
from clawr1.core.records import Lease, Sample, SessionEvent
from clawr1.datapool import ops
from clawr1.datapool.base import UnknownLeaseError

log = logging.getLogger(__name__)
POISON = "poison"  # the drop reason of a sample whose training failed `pool.max_lease_attempts` times
LEASE_FAILED = "lease_failed"  # the session event of each failed training attempt of one of its samples


def expire_leases(conn: sqlite3.Connection, now: float, max_attempts: int) -> int:
    """Expired leases' samples go back to READY; they keep the lease id so a late ack still
    consumes the ones nobody leased again. Each counts a failed attempt (`_failed`): a trainer
    that dies on a sample (out of host memory, a crash in a kernel) would otherwise lease it, die
    and get it back forever."""
    expired = "SELECT lease_id FROM leases WHERE state = 'open' AND expires_at <= ?1"
    back = [tuple(row) for row in conn.execute(f"SELECT step_id, reward, lease_id FROM samples WHERE status = 'leased' "
                                               f"AND lease_id IN ({expired})", (now,))]
    returned = conn.execute("UPDATE samples SET status = 'ready', updated_at = ?1 "
                            f"WHERE status = 'leased' AND lease_id IN ({expired})", (now,)).rowcount
    conn.execute(f"UPDATE leases SET state = 'expired', closed_at = ?1 WHERE lease_id IN ({expired})", (now,))
    _returned(conn, [(step_id, reward) for step_id, reward, _ in back])
    dropped = _failed(conn, [(step_id, lease_id, "its lease expired unacknowledged (the trainer stopped or died)")
                             for step_id, _, lease_id in back], max_attempts, now)
    return returned - dropped


def _returned(conn: sqlite3.Connection, back: list[tuple[str, float | None]]) -> None:
    """A reward that came while the sample was leased was kept as history only; nothing was trained
    on it after all, so the one that should stand (a person's feedback over the judge) applies now."""
    for step_id, reward in back:
        score = ops._effective_score(conn, step_id)
        if score is not None and score != reward:
            ops._apply(conn, step_id, score)


def _failed(conn: sqlite3.Connection, failures: list[tuple[str, str, str]], max_attempts: int, now: float) -> int:
    """Count a failed training attempt of each READY sample of `failures` (step id, lease id, why),
    as a `lease_failed` event of its session (the pool's append-only log: `clawr1 pool show`
    lists them); one that failed `max_attempts` times is dropped as `poison`, which `pool stats`
    and the dashboard count among the drop reasons. Returns how many were dropped."""
    dropped = 0
    for step_id, lease_id, error in failures:
        row = conn.execute("SELECT tenant, session_id FROM samples WHERE step_id = ? AND status = 'ready'",
                           (step_id,)).fetchone()
        if row is None:  # consumed by a late ack, or dropped meanwhile
            continue
        tenant, session_id = row
        attempt = 1 + sum(json.loads(data).get("step_id") == step_id for (data,) in conn.execute(
            "SELECT data FROM events WHERE tenant = ? AND session_id = ? AND kind = ?",
            (tenant, session_id, LEASE_FAILED)))
        ops._insert_event(conn, SessionEvent(session_id, LEASE_FAILED, tenant, created_at=now, data={
            "step_id": step_id, "lease_id": lease_id, "error": error, "attempt": attempt}))
        if attempt >= max_attempts:
            conn.execute("UPDATE samples SET status = 'dropped', reason = ?, updated_at = ? WHERE step_id = ?",
                         (POISON, now, step_id))
            dropped += 1
            log.warning("sample %s dropped as poison: %d failed training attempts, the last: %s", step_id, attempt,
                        error)
    return dropped


def release(conn: sqlite3.Connection, lease_id: str, failed: dict[str, str], max_attempts: int) -> int:
    """Give an open lease back now, unacknowledged: its samples return to READY (the trainer could
    not train them); each of `failed` (step id -> why) counts a failed attempt (`_failed`).
    Returns how many samples went back to READY."""
    now = ops.clock()
    row = conn.execute("SELECT state FROM leases WHERE lease_id = ?", (lease_id,)).fetchone()
    if row is None:
        raise UnknownLeaseError(lease_id)
    if row[0] != "open":
        return 0  # acknowledged, or expired already (its samples came back then)
    back = [tuple(r) for r in conn.execute("SELECT step_id, reward FROM samples WHERE status = 'leased' "
                                           "AND lease_id = ?", (lease_id,))]
    conn.execute("UPDATE samples SET status = 'ready', updated_at = ? WHERE status = 'leased' AND lease_id = ?",
                 (now, lease_id))
    conn.execute("UPDATE leases SET state = 'expired', closed_at = ? WHERE lease_id = ?", (now, lease_id))
    _returned(conn, back)
    mine = {step_id for step_id, _ in back}
    return len(back) - _failed(conn, [(step_id, lease_id, error) for step_id, error in failed.items()
                                      if step_id in mine], max_attempts, now)


_PICK = """SELECT step_id, policy_version, weight, reward, reason FROM samples
WHERE status = 'ready' AND policy_version {cmp} ? AND tenant = coalesce(?, tenant)
ORDER BY policy_version DESC, ready_at LIMIT ?{lock}"""


def _rest_of_groups(conn: sqlite3.Connection, chosen: list[tuple], tenant: str | None, lock: str) -> list[tuple]:
    """The READY samples that share a prompt id (a GRPO group: the choices of one prompt) with
    one of `chosen` and are not among them: a lease takes a group whole, so it may hold up to a
    group's size - 1 more than asked. Cut, the group's advantages were normalised over a part of
    it (the trainer computes them per lease), and a member left alone was taken for a lone online
    sample. Costs one pass over the READY samples (their partial index, a key lookup each)."""
    if not chosen:
        return []
    ids = [row[0] for row in chosen]
    marks = ", ".join("?" * len(ids))
    keys = {(t, p) for t, p in conn.execute(f"SELECT tenant, prompt_id FROM steps WHERE step_id IN ({marks})", ids)}
    prompts = sorted({p for _, p in keys})
    members = conn.execute(
        "SELECT s.step_id, s.policy_version, s.weight, s.reward, s.reason, t.tenant, t.prompt_id FROM samples s "
        "JOIN steps t ON t.step_id = s.step_id WHERE s.status = 'ready' AND s.tenant = coalesce(?, s.tenant) "
        f"AND t.prompt_id IN ({', '.join('?' * len(prompts))}){lock}", (tenant, *prompts)).fetchall()
    taken = set(ids)
    return [tuple(row[:5]) for row in members if (row[5], row[6]) in keys and row[0] not in taken]


def lease(conn: sqlite3.Connection, lease_id: str, n: int, max_staleness: int, current_version: int,
          config: PoolConfig, tenant: str | None = None) -> Lease:
    now = ops.clock()
    expire_leases(conn, now, config.max_lease_attempts)
    floor = current_version - max_staleness
    # Staleness is measured against the version of the adapter being trained: with per-tenant
    # adapters, only that tenant's samples (its own version line).
    if config.stale_policy == "drop":
        conn.execute("UPDATE samples SET status = 'dropped', reason = 'stale', updated_at = ? "
                     "WHERE status = 'ready' AND policy_version < ? AND tenant = coalesce(?, tenant)",
                     (now, floor, tenant))
    else:
        conn.execute("UPDATE samples SET weight = ?, reason = 'stale', updated_at = ? "
                     "WHERE status = 'ready' AND policy_version < ? AND coalesce(reason, '') <> 'stale' "
                     "AND tenant = coalesce(?, tenant)", (config.stale_weight, now, floor, tenant))
    # Several trainers on one PostgreSQL pool: each takes rows no other open lease is taking.
    lock = "" if isinstance(conn, sqlite3.Connection) else " FOR UPDATE SKIP LOCKED"
    fresh = conn.execute(_PICK.format(cmp=">=", lock=lock), (current_version, tenant, n)).fetchall()
    older = conn.execute(_PICK.format(cmp="<", lock=lock), (current_version, tenant, n)).fetchall()
    # Aim for the configured share of fresh samples; either kind fills in when the other is short.
    take_fresh = min(len(fresh), max(round(n * config.fresh_fraction), n - len(older)))
    chosen = fresh[:take_fresh] + older[:n - take_fresh]
    chosen += _rest_of_groups(conn, chosen, tenant, lock)
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


def ack(conn: sqlite3.Connection, lease_id: str, max_attempts: int) -> int:
    now = ops.clock()
    expire_leases(conn, now, max_attempts)
    row = conn.execute("SELECT state FROM leases WHERE lease_id = ?", (lease_id,)).fetchone()
    if row is None:
        raise UnknownLeaseError(lease_id)
    if row[0] == "acked":
        return 0  # a double ack is harmless
    consumed = conn.execute("UPDATE samples SET status = 'consumed', updated_at = ? WHERE lease_id = ? "
                            "AND status IN ('leased', 'ready')", (now, lease_id)).rowcount
    conn.execute("UPDATE leases SET state = 'acked', closed_at = ? WHERE lease_id = ?", (now, lease_id))
    return consumed
