"""Reads: counts, session listings, one record in full, and the export rows.

Under WAL these never block the writer and see only committed data; the caller runs each inside
one read transaction, so the numbers of one call come from one snapshot.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from clawr1.core.records import SAMPLE_STATUSES, Step
from clawr1.datapool.base import EXPORT_FORMATS, ExportFilter, UnknownStepError
from clawr1.datapool.schema import dumps, next_state_of, row_step


def _one(conn: sqlite3.Connection, sql: str, *params: Any) -> Any:
    return conn.execute(sql, params).fetchone()[0]


def stats(conn: sqlite3.Connection, tenant: str | None = None) -> dict[str, Any]:
    mine = "tenant = coalesce(?1, tenant)"  # one tenant's counts, or everyone's (NULL: all)

    def one(sql: str) -> Any:
        sql = sql.format(mine=mine)
        return _one(conn, sql, *([tenant] if "?1" in sql else []))

    by_status = dict.fromkeys(SAMPLE_STATUSES, 0)
    by_status.update(conn.execute(f"SELECT status, count(*) FROM samples WHERE {mine} GROUP BY status",
                                  (tenant,)).fetchall())
    versions = conn.execute(f"SELECT min(policy_version), max(policy_version) FROM samples WHERE {mine}",
                            (tenant,)).fetchone()
    in_steps = f"step_id IN (SELECT step_id FROM samples WHERE {mine})"  # rewards and hints are of main turns
    return {
        "sessions": one("SELECT count(*) FROM sessions WHERE {mine}"),
        "open_sessions": one("SELECT count(*) FROM sessions WHERE status = 'open' AND {mine}"),
        "steps": one("SELECT count(*) FROM steps WHERE {mine}"),
        "main_steps": one("SELECT count(*) FROM samples WHERE {mine}"),  # one sample a main turn: no big-row scan
        "rewards": one("SELECT count(*) FROM rewards" + ("" if tenant is None else f" WHERE {in_steps}")),
        "hints": one("SELECT count(*) FROM hints" + ("" if tenant is None else f" WHERE {in_steps}")),
        **by_status,
        "dropped_by_reason": dict(conn.execute(f"SELECT reason, count(*) FROM samples WHERE status = 'dropped' "
                                               f"AND {mine} GROUP BY reason", (tenant,)).fetchall()),
        # Turns the reward worker gave up judging (`reward.max_judge_attempts`): never trained on.
        "judge_gave_up": one("SELECT count(*) FROM samples WHERE judge_gave_up_at IS NOT NULL AND {mine}"),
        "stored_bytes": one("SELECT coalesce(sum(bytes), 0) FROM tenant_usage WHERE {mine}"),
        "open_leases": _one(conn, "SELECT count(*) FROM leases WHERE state = 'open'"),
        "policy_versions": None if versions[0] is None else list(versions),  # [oldest, newest]
    }


# Every column but key_hash: even a key's hash stays out of listings.
_SESSION_COLUMNS = "s.tenant, s.session_id, s.status, s.created_at, s.updated_at, s.closed_at, s.outcome_reward"


def sessions(conn: sqlite3.Connection, limit: int, tenant: str | None = None) -> list[dict[str, Any]]:
    rows = conn.execute(
        f"SELECT {_SESSION_COLUMNS}, (SELECT count(*) FROM steps t WHERE t.tenant = s.tenant AND t.session_id = s.session_id) AS steps "
        "FROM sessions s WHERE s.tenant = coalesce(?2, s.tenant) ORDER BY s.updated_at DESC LIMIT ?1", (limit, tenant)).fetchall()
    return [dict(row) for row in rows]


def samples(conn: sqlite3.Connection, limit: int, status: str | None, tenant: str | None) -> list[dict[str, Any]]:
    if status is not None and status not in SAMPLE_STATUSES:
        raise ValueError(f"sample status must be one of {', '.join(SAMPLE_STATUSES)}, got {status!r}")
    rows = conn.execute(
        "SELECT step_id, tenant, session_id, turn_index, policy_version, status, reward, weight, reason, lease_id, "
        "ready_at, updated_at FROM samples WHERE status = coalesce(?1, status) AND tenant = coalesce(?2, tenant) "
        "ORDER BY updated_at DESC LIMIT ?3", (status, tenant, limit)).fetchall()
    return [dict(row) for row in rows]


def versions(conn: sqlite3.Connection, tenant: str | None) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT policy_version AS version, count(*) AS turns, count(reward) AS rewarded, avg(reward) AS mean_reward, "
        "sum(CASE WHEN reward > 0 THEN 1 ELSE 0 END) AS approved, "
        "sum(CASE WHEN reward < 0 THEN 1 ELSE 0 END) AS corrected FROM samples "
        "WHERE tenant = coalesce(?1, tenant) GROUP BY policy_version ORDER BY policy_version", (tenant,)).fetchall()
    # min() per group on the (policy_version, created_at) index: one seek per version, no row scan.
    first = dict(conn.execute("SELECT policy_version, min(created_at) FROM steps GROUP BY policy_version").fetchall())
    served = {row["version"]: dict(row) for row in rows}
    empty = {"turns": 0, "rewarded": 0, "mean_reward": None, "approved": 0, "corrected": 0}
    # A version that served only side turns (or other tenants) still has its first reply.
    return [{**served.get(v, empty), "version": v, "first_served_at": first.get(v)}
            for v in sorted(first.keys() | served.keys())]


def lease_ready_times(conn: sqlite3.Connection, lease_ids: list[str]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {lease: [] for lease in lease_ids}
    for start in range(0, len(lease_ids), 500):
        chunk = lease_ids[start:start + 500]
        for lease, ready_at in conn.execute(f"SELECT lease_id, ready_at FROM samples WHERE lease_id IN "
                                            f"({', '.join('?' * len(chunk))}) AND ready_at IS NOT NULL", chunk):
            out[lease].append(ready_at)
    return out


# A step with the messages of the next main turn it is linked to (its next state comes from them).
_STEP_WITH_NEXT = """SELECT t.*, s.next_step_id, n.messages AS next_messages FROM steps t
LEFT JOIN samples s ON s.step_id = t.step_id LEFT JOIN steps n ON n.step_id = s.next_step_id"""


def get_steps(conn: sqlite3.Connection, step_ids: list[str]) -> list[Step]:
    found: dict[str, Step] = {}
    for start in range(0, len(step_ids), 500):  # stay under SQLite's bound-parameter limit
        chunk = step_ids[start:start + 500]
        marks = ", ".join("?" * len(chunk))
        for row in conn.execute(f"{_STEP_WITH_NEXT} WHERE t.step_id IN ({marks})", chunk):
            found[row["step_id"]] = row_step(row, row["next_messages"])
    missing = [s for s in step_ids if s not in found]
    if missing:
        raise UnknownStepError(", ".join(missing[:5]))
    return [found[s] for s in step_ids]


def ready_state(conn: sqlite3.Connection, tenant: str | None = None) -> tuple[int, float | None]:
    """(READY samples, when the oldest of them became ready): the trainer's "is a batch due?"."""
    count, oldest = conn.execute("SELECT count(*), min(ready_at) FROM samples WHERE status = 'ready' "
                                 "AND tenant = coalesce(?1, tenant)", (tenant,)).fetchone()
    return count, oldest


def ready_tenants(conn: sqlite3.Connection) -> list[str]:
    return [r[0] for r in conn.execute("SELECT DISTINCT tenant FROM samples WHERE status = 'ready' ORDER BY tenant")]


def hints(conn: sqlite3.Connection, step_ids: list[str]) -> dict[str, str]:
    """The hint each step trains with: explicit feedback first, else the judge's; the latest of a kind."""
    out: dict[str, str] = {}
    for start in range(0, len(step_ids), 500):
        chunk = step_ids[start:start + 500]
        rows = conn.execute(f"SELECT step_id, text FROM hints WHERE step_id IN ({', '.join('?' * len(chunk))}) "
                            "ORDER BY source = 'feedback', id", chunk).fetchall()
        for step_id, text in rows:  # ascending: the preferred hint comes last and wins
            out[step_id] = text
    return out


def previous_turns(conn: sqlite3.Connection, step_ids: list[str]) -> dict[str, str]:
    """step id -> the step id of the main turn before it (the one whose `next_step_id` it is)."""
    out: dict[str, str] = {}
    for start in range(0, len(step_ids), 500):
        chunk = step_ids[start:start + 500]
        rows = conn.execute("SELECT n.step_id, p.step_id FROM samples n JOIN samples p ON p.tenant = n.tenant "
                            "AND p.session_id = n.session_id AND p.next_step_id = n.step_id "
                            f"WHERE n.step_id IN ({', '.join('?' * len(chunk))})", chunk).fetchall()
        out.update(dict(rows))
    return out


def unjudged(conn: sqlite3.Connection, limit: int, shard: tuple[int, int], now: float) -> list[str]:
    """Shard `shard = (i, n)`'s main turns whose next state has arrived, that carry no reward yet, that
    the judge has not given up on and whose retry time (after a failed attempt) has come; oldest
    change first. The shard is filtered here, not by the worker, so a worker whose shard is stuck
    (slow, dead, failing) never fills another's page (the `samples_unjudged` index's order)."""
    rows = conn.execute("SELECT step_id FROM samples WHERE status = 'pending' AND reward IS NULL "
                        "AND next_step_id IS NOT NULL AND judge_gave_up_at IS NULL AND shard_key % ? = ? "
                        "AND coalesce(judge_retry_at, 0) <= ? ORDER BY updated_at LIMIT ?",
                        (shard[1], shard[0], now, limit)).fetchall()
    return [r[0] for r in rows]


def tenant_usage(conn: sqlite3.Connection) -> dict[str, int]:
    return dict(conn.execute("SELECT tenant, bytes FROM tenant_usage").fetchall())


def last_turn(conn: sqlite3.Connection, tenant: str, session_id: str) -> int | None:
    return _one(conn, "SELECT max(turn_index) FROM steps WHERE tenant = ? AND session_id = ?", tenant, session_id)


def session_by_key(conn: sqlite3.Connection, key_hash: str) -> tuple[str, str, str] | None:
    row = conn.execute("SELECT tenant, session_id, status FROM sessions WHERE key_hash = ?", (key_hash,)).fetchone()
    return None if row is None else tuple(row)


def _step_detail(conn: sqlite3.Connection, row: sqlite3.Row) -> dict[str, Any]:
    step = row_step(row, row["next_messages"])
    detail = {**step.__dict__, "next_step_id": row["next_step_id"]}
    sample = conn.execute("SELECT * FROM samples WHERE step_id = ?", (step.step_id,)).fetchone()
    detail["sample"] = None if sample is None else dict(sample)
    detail["rewards"] = [{**dict(r), "votes": json.loads(r["votes"])}
                         for r in conn.execute("SELECT * FROM rewards WHERE step_id = ? ORDER BY id", (step.step_id,))]
    hints = conn.execute("SELECT * FROM hints WHERE step_id = ? ORDER BY id", (step.step_id,))
    detail["hints"] = [dict(r) for r in hints]
    return detail


def show(conn: sqlite3.Connection, ident: str, tenant: str | None, kind: str | None = None) -> dict[str, Any]:
    """One step (`kind="step"`), one session (`"session"`), or, for a person at the CLI (`None`),
    whichever `ident` names. Both lookups keep to `tenant` when one is given: the gateway asks for
    sessions only, so a session named like another tenant's step id never reads that step."""
    if kind in (None, "step"):
        row = conn.execute(f"{_STEP_WITH_NEXT} WHERE t.step_id = ? AND t.tenant = coalesce(?, t.tenant)",
                           (ident, tenant)).fetchone()
        if row is not None:
            return {"kind": "step", **_step_detail(conn, row)}
        if kind == "step":
            raise KeyError(f"no step {ident!r}")
    found = conn.execute(f"SELECT {_SESSION_COLUMNS} FROM sessions s WHERE session_id = ? "
                         "AND tenant = coalesce(?, tenant)", (ident, tenant)).fetchall()
    if not found:
        raise KeyError(f"no session {ident!r}" if kind == "session" else f"no step or session {ident!r}")
    if len(found) > 1:
        raise ValueError(f"session {ident!r} exists for tenants {[r['tenant'] for r in found]}; name one")
    session = dict(found[0])
    key = (session["tenant"], ident)
    session["steps"] = [dict(r) for r in conn.execute(
        "SELECT t.step_id, t.turn_index, t.turn_type, t.policy_version, t.finish_reason, t.text, s.next_step_id, "
        "s.status, s.reward, s.reason, s.judge_attempts, s.judge_error, s.judge_gave_up_at "
        "FROM steps t LEFT JOIN samples s ON s.step_id = t.step_id "
        "WHERE t.tenant = ? AND t.session_id = ? ORDER BY t.turn_index, t.created_at", key)]
    # Every turn's rewards (votes, evidence) and hints, so one read explains the whole session.
    judged: dict[str, dict[str, list]] = {t["step_id"]: {"rewards": [], "hints": []} for t in session["steps"]}
    for r in conn.execute("SELECT r.* FROM rewards r JOIN steps t ON t.step_id = r.step_id "
                          "WHERE t.tenant = ? AND t.session_id = ? ORDER BY r.id", key):
        judged[r["step_id"]]["rewards"].append({**dict(r), "votes": json.loads(r["votes"])})
    for h in conn.execute("SELECT h.* FROM hints h JOIN steps t ON t.step_id = h.step_id "
                          "WHERE t.tenant = ? AND t.session_id = ? ORDER BY h.id", key):
        judged[h["step_id"]]["hints"].append(dict(h))
    for turn in session["steps"]:
        turn.update(judged[turn["step_id"]])
    session["events"] = [{**dict(r), "data": json.loads(r["data"])} for r in conn.execute(
        "SELECT kind, data, created_at FROM events WHERE tenant = ? AND session_id = ? ORDER BY id", key)]
    return {"kind": "session", **session}


def _text_content(content: Any) -> Any:
    """OpenAI content-part arrays to plain text, the form TRL's chat templates expect."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content


# Each optional bound of an ExportFilter and the condition it adds (reward bounds exclude NULL rewards).
_BOUNDS = (("tenant", "t.tenant = ?"), ("since", "t.created_at >= ?"), ("until", "t.created_at < ?"),
           ("min_reward", "s.reward >= ?"), ("max_reward", "s.reward <= ?"),
           ("min_version", "t.policy_version >= ?"), ("max_version", "t.policy_version <= ?"))

# The hint a step trains with, as `hints()` picks it: explicit feedback first, then the latest.
_HINT = "(SELECT h.text FROM hints h WHERE h.step_id = t.step_id ORDER BY h.source = 'feedback' DESC, h.id DESC LIMIT 1)"


def export_rows(conn: sqlite3.Connection, filters: ExportFilter) -> Iterator[dict[str, Any]]:
    """Main turns as TRL conversational prompt/completion rows with their reward, hint and provenance."""
    where, params = ["t.turn_type = 'main'"], []
    for name, condition in _BOUNDS:
        value = getattr(filters, name)
        if value is not None:
            where.append(condition)
            params.append(value)
    if filters.rewarded_only:
        where.append("s.reward IS NOT NULL")
    for row in conn.execute(
            "SELECT t.step_id, t.tenant, t.session_id, t.prompt_id, t.turn_index, t.policy_version, t.messages, "
            "t.tools, t.text, t.finish_reason, t.created_at, t.memory, n.messages AS next_messages, s.reward, s.status, "
            f"{_HINT} AS hint FROM steps t JOIN samples s ON s.step_id = t.step_id "
            f"LEFT JOIN steps n ON n.step_id = s.next_step_id WHERE {' AND '.join(where)} ORDER BY t.rowid", params):
        prompt = [_export_message(m) for m in json.loads(row["messages"])]
        next_messages = None if row["next_messages"] is None else json.loads(row["next_messages"])
        yield {
            "prompt": prompt,
            "completion": [{"role": "assistant", "content": row["text"]}],
            "reward": row["reward"],
            "hint": row["hint"],
            "tools": row["tools"],  # JSON text: tool schemas differ per row, a column needs one type
            "step_id": row["step_id"], "tenant": row["tenant"], "session_id": row["session_id"],
            "prompt_id": row["prompt_id"], "turn_index": row["turn_index"],
            "policy_version": row["policy_version"], "created_at": row["created_at"],
            "finish_reason": row["finish_reason"], "status": row["status"],
            "next_state": None if next_messages is None else dumps(next_state_of(next_messages)),
            # JSON text: whose memory the prompt carried, its entries (id, text), the text they added.
            "memory": row["memory"],
        }


def _export_message(message: dict[str, Any]) -> dict[str, Any]:
    """A stored message as an export row holds it: text content, and tool-call arguments as JSON
    text (OpenAI's form; clients may send an object, and a column needs one type: Parquet cannot
    mix text and objects, nor write an empty object)."""
    out = {**message, "content": _text_content(message.get("content"))}
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_call_with_text_arguments(call) for call in calls]
    return out


def _call_with_text_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or isinstance(function.get("arguments"), str):
        return call
    return {**call, "function": {**function, "arguments": json.dumps(function.get("arguments", {}))}}


def export(conn: sqlite3.Connection, path: Path, format: str, filters: ExportFilter) -> int:
    """Write to a temporary file (or directory), then rename: a reader never sees half an export."""
    if format not in EXPORT_FORMATS:
        raise ValueError(f"export format must be jsonl or parquet (a file) or hf (a datasets directory), "
                         f"got {format!r}")
    path = Path(path)
    if format == "hf" and path.exists():  # a directory is not overwritten: it may hold anything
        raise FileExistsError(f"{path} exists; remove it or choose another path for the hf export")
    tmp = path.with_name(path.name + ".tmp")
    write = {"jsonl": _write_jsonl, "parquet": _write_parquet, "hf": _write_hf}[format]
    try:
        count = write(export_rows(conn, filters), tmp)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)  # no half-written leftovers; the error itself propagates
        raise
    return count


def _write_jsonl(rows: Iterator[dict[str, Any]], tmp: Path) -> int:
    count = 0
    with open(tmp, "w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count


def _write_parquet(rows: Iterator[dict[str, Any]], tmp: Path) -> int:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ImportError("parquet export needs pyarrow (pip install pyarrow); jsonl needs nothing") from error
    table = pa.Table.from_pylist(list(rows))
    pq.write_table(table, tmp)
    return table.num_rows


def _write_hf(rows: Iterator[dict[str, Any]], tmp: Path) -> int:
    """A `datasets.Dataset.save_to_disk` directory (imported here: the package is an optional extra)."""
    try:
        import datasets
    except ImportError as error:
        raise ImportError("hf export needs the datasets package: pip install 'clawr1[export]' "
                          "(jsonl and parquet do not)") from error
    _remove(tmp)  # left by an export that was killed
    dataset = datasets.Dataset.from_list(list(rows))
    dataset.save_to_disk(str(tmp))
    return dataset.num_rows


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def policy_versions(conn: sqlite3.Connection, adapter: str | None) -> list[dict[str, Any]]:
    rows = conn.execute("SELECT adapter, version, status, reason, scores, decided_at FROM policy_versions "
                        "WHERE adapter = coalesce(?1, adapter) ORDER BY id", (adapter,)).fetchall()
    return [{**dict(row), "scores": json.loads(row["scores"])} for row in rows]


# ---- per-user memory ---------------------------------------------------------------------------

_ENTRY_COLUMNS = ("id, tenant, user_id, text, topic, status, reason, source, step_id, session_id, correction, "
                  "replaced_by, created_at, updated_at, rev, gap, checked_version, checks")


def _entry(row: Any) -> dict[str, Any]:
    entry = dict(row)
    entry["checks"] = json.loads(entry["checks"] or "[]")
    return entry


def memory_entries(conn: sqlite3.Connection, tenant: str | None, user: str | None, status: str | None,
                   limit: int) -> list[dict[str, Any]]:
    """Entries, newest first, of one tenant / user / status or all."""
    rows = conn.execute(f"SELECT {_ENTRY_COLUMNS} FROM memory_entries WHERE tenant = coalesce(?1, tenant) "
                        "AND user_id = coalesce(?2, user_id) AND status = coalesce(?3, status) ORDER BY id DESC "
                        "LIMIT ?4", (tenant, user, status, limit)).fetchall()
    return [_entry(row) for row in rows]


def memory_entry(conn: sqlite3.Connection, entry_id: int, tenant: str | None) -> dict[str, Any]:
    """One entry, with the entries it replaced."""
    row = conn.execute(f"SELECT {_ENTRY_COLUMNS} FROM memory_entries WHERE id = ? AND tenant = coalesce(?, tenant)",
                       (entry_id, tenant)).fetchone()
    if row is None:
        raise KeyError(f"no memory entry {entry_id}")
    entry = _entry(row)
    entry["replaced"] = [_entry(r) for r in conn.execute(
        f"SELECT {_ENTRY_COLUMNS} FROM memory_entries WHERE replaced_by = ? ORDER BY id", (entry_id,))]
    return entry


def memory_recheck(conn: sqlite3.Connection, tenant: str | None, limit: int) -> list[dict[str, Any]]:
    """Retired entries (of one tenant, or all), the longest unchecked first: id, user_id and the
    step ids each is measured again on."""
    rows = conn.execute("SELECT id, user_id, retired_on FROM memory_entries WHERE status = 'retired' "
                        "AND tenant = coalesce(?, tenant) ORDER BY coalesce(checked_version, 0), id LIMIT ?",
                        (tenant, limit)).fetchall()
    return [{"id": r[0], "user_id": r[1], "steps": json.loads(r[2] or "[]")} for r in rows]


def memory_changes(conn: sqlite3.Connection, entries_since: int, switches_since: int) -> dict[str, Any]:
    """What changed since the given change numbers: every entry row changed (from 0: the active
    ones only) and every switch, with the newest change numbers to ask from next time."""
    status = "" if entries_since else " AND status = 'active'"
    entries = [dict(r) for r in conn.execute(
        f"SELECT id, tenant, user_id, text, status, created_at, rev FROM memory_entries WHERE rev > ?{status} "
        "ORDER BY rev, id", (entries_since,))]
    switches = [dict(r) for r in conn.execute(
        "SELECT tenant, user_id, off, rev FROM memory_switches WHERE rev > ? ORDER BY rev", (switches_since,))]
    return {"entries": entries, "switches": switches,
            "entries_rev": _one(conn, "SELECT coalesce(max(rev), 0) FROM memory_entries"),
            "switches_rev": _one(conn, "SELECT coalesce(max(rev), 0) FROM memory_switches")}


def memory_switches(conn: sqlite3.Connection, tenant: str | None) -> list[dict[str, Any]]:
    """Where the memory is switched off at run time: (tenant, user_id ('' = the whole tenant), since)."""
    rows = conn.execute("SELECT tenant, user_id, updated_at FROM memory_switches WHERE off = 1 "
                        "AND tenant = coalesce(?, tenant) ORDER BY tenant, user_id", (tenant,)).fetchall()
    return [dict(row) for row in rows]
