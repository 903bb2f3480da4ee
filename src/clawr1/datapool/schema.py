"""SQLite schema, connection settings, and the Step <-> row encoding.

Token ids are stored as little-endian int32 and logprobs as little-endian float64 blobs: 4 and 8
bytes a token, packed and unpacked by `struct` in one call, and float64 so the behaviour logprobs
the trainer's importance ratio uses come back bit-exact. Messages, tools and timings are JSON text,
readable in any SQLite shell.

Steps are append-only. A main turn's next state is not copied into it: its sample row links to the
session's next main turn, whose messages after the last assistant reply are that next state.

Schema versions: v2 added the judge's bookkeeping to samples (shard key, failed attempts, the
give-up); v3 the guard's decision log (`policy_versions`); v4 each tenant's stored bytes
(`tenant_usage`, counted from the steps an older file holds when it is opened) and each step's
sampling cut (`top_p`, `top_k`: older steps were sampled uncut, the defaults). An older file gets
the columns it lacks (`ADDED_COLUMNS`) when it is opened; a newer one is refused. v5 added the
per-user memory (`memory_entries`, `memory_switches`) and each step's memory record (`steps.memory`:
which entries its prompt carried and the text they added; `clawr1/core/memory.py`).
"""

from __future__ import annotations

import json
import sqlite3
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clawr1.core.config import PoolConfig
from clawr1.core.records import Step

SCHEMA_VERSION = 5

SCHEMA = """
CREATE TABLE IF NOT EXISTS steps (
    step_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    prompt_id TEXT NOT NULL,
    turn_index INTEGER NOT NULL,
    turn_type TEXT NOT NULL CHECK (turn_type IN ('main', 'side')),
    policy_version INTEGER NOT NULL,
    adapter TEXT,
    finish_reason TEXT NOT NULL,
    temperature REAL NOT NULL,
    top_p REAL NOT NULL DEFAULT 1.0,
    top_k INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    messages TEXT NOT NULL,
    tools TEXT,
    text TEXT NOT NULL,
    prompt_ids BLOB NOT NULL,
    token_ids BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    timings TEXT NOT NULL,
    memory TEXT  -- JSON (schema v5): whose memory the prompt carried, which entries, the text added (NULL: none)
);
-- Steps are never updated: per-sample state lives in the small `samples` rows.
CREATE INDEX IF NOT EXISTS steps_by_session ON steps (tenant, session_id, turn_index);
-- When each policy version first answered (the dashboard's feedback-to-serving latency): an index
-- lookup per version instead of a scan of the big step rows.
CREATE INDEX IF NOT EXISTS steps_by_version ON steps (policy_version, created_at);

CREATE TABLE IF NOT EXISTS sessions (
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    closed_at REAL,
    outcome_reward REAL,
    key_hash TEXT,  -- sha256 of the session's own API key (POST /admin/sessions); never the key
    PRIMARY KEY (tenant, session_id)
);
CREATE INDEX IF NOT EXISTS sessions_by_update ON sessions (updated_at);
CREATE INDEX IF NOT EXISTS sessions_idle ON sessions (updated_at) WHERE status = 'open';
CREATE UNIQUE INDEX IF NOT EXISTS sessions_by_key ON sessions (key_hash) WHERE key_hash IS NOT NULL;

CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    data TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_session ON events (tenant, session_id);

CREATE TABLE IF NOT EXISTS rewards (
    id INTEGER PRIMARY KEY,
    step_id TEXT NOT NULL,
    score REAL NOT NULL CHECK (score BETWEEN -1 AND 1),
    source TEXT NOT NULL,
    votes TEXT NOT NULL,
    evidence TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS rewards_by_step ON rewards (step_id);

CREATE TABLE IF NOT EXISTS hints (
    id INTEGER PRIMARY KEY,
    step_id TEXT NOT NULL,
    text TEXT NOT NULL,
    source TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS hints_by_step ON hints (step_id);

-- One row per main turn: its place in the training queue and its link to the next main turn
-- (whose messages hold this turn's next state). Small rows, so queue and link updates are cheap.
-- The judge's bookkeeping (schema v2): the turn's shard (`shard_key % n`: which of n judge workers
-- takes it), its failed attempts with the last error, when it may be tried again, and when the
-- judge gave up on it.
CREATE TABLE IF NOT EXISTS samples (
    step_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    turn_index INTEGER NOT NULL,
    policy_version INTEGER NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'ready', 'leased', 'consumed', 'dropped')),
    weight REAL NOT NULL,
    reward REAL,
    reason TEXT,
    lease_id TEXT,
    next_step_id TEXT,
    ready_at REAL,
    updated_at REAL NOT NULL,
    shard_key INTEGER NOT NULL DEFAULT 0,
    judge_attempts INTEGER NOT NULL DEFAULT 0,
    judge_error TEXT,
    judge_retry_at REAL,
    judge_gave_up_at REAL
) WITHOUT ROWID;  -- looked up by key: one b-tree instead of two
-- The READY queue in lease()'s order (newest version first, oldest first within it): no sort.
-- Partial, so the many PENDING, CONSUMED and DROPPED samples cost it nothing.
CREATE INDEX IF NOT EXISTS samples_ready ON samples (policy_version DESC, ready_at) WHERE status = 'ready';
CREATE INDEX IF NOT EXISTS samples_by_session ON samples (tenant, session_id, turn_index);
CREATE INDEX IF NOT EXISTS samples_by_lease ON samples (lease_id) WHERE lease_id IS NOT NULL;
-- The judge's work list in `unjudged()`'s order: its poll reads only the turns waiting for a judge.
CREATE INDEX IF NOT EXISTS samples_unjudged ON samples (updated_at)
WHERE status = 'pending' AND reward IS NULL AND next_step_id IS NOT NULL AND judge_gave_up_at IS NULL;

-- Sessions, samples and next-state links are maintained by `ops.insert_steps`, once per batch.
-- Early files kept that in a per-row trigger, which would now do it twice.
DROP TRIGGER IF EXISTS step_stored;

CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY,
    state TEXT NOT NULL CHECK (state IN ('open', 'acked', 'expired')),
    n INTEGER NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    closed_at REAL
);
CREATE INDEX IF NOT EXISTS leases_by_state ON leases (state, expires_at);

-- The version log (schema v3), append-only: each version of each adapter as the trainer published
-- it (`trained`, its metrics as scores), then promoted or rejected by the guard and why, with the
-- probe scores it was judged on; pins and rollbacks too.
CREATE TABLE IF NOT EXISTS policy_versions (
    id INTEGER PRIMARY KEY,
    adapter TEXT NOT NULL,
    version INTEGER NOT NULL,
    status TEXT NOT NULL,
    reason TEXT NOT NULL,
    scores TEXT NOT NULL,
    decided_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS policy_versions_by_adapter ON policy_versions (adapter, version);

-- Per-user memory (schema v5): an entry is a hint from a correction of a user's turn, kept for
-- that user (`user_id`: `user:<id>`, `session:<id>` or `tenant`, within its tenant), with where it
-- came from (the corrected step, its session, the correction) and its fate: `active` (added to the
-- user's prompts), `replaced` (by `replaced_by`, a newer entry on its topic), `forgotten` (an
-- admin), `refused` (bad input: `reason`), `evicted` (past the per-user cap), `retired` (the
-- weights learned it: `gap`, the last version's measure, and `checks`, the versions' measures;
-- `retired_on`, the steps it is measured again on). `rev` grows with every change (one value per
-- transaction): a gateway reads only the rows changed since its last.
CREATE TABLE IF NOT EXISTS memory_entries (
    id INTEGER PRIMARY KEY,
    tenant TEXT NOT NULL,
    user_id TEXT NOT NULL,
    text TEXT NOT NULL,
    topic TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('active', 'replaced', 'forgotten', 'refused', 'evicted', 'retired')),
    reason TEXT,
    source TEXT NOT NULL,
    step_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    correction TEXT,
    replaced_by INTEGER,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    rev INTEGER NOT NULL,
    gap REAL,  -- nats a token: the teacher with the entry over the served version without it
    checked_version INTEGER,  -- the version `gap` was measured on
    checks TEXT,  -- JSON: [{version, gap, tokens}], the newest last
    retired_on TEXT  -- JSON: the step ids a retired entry is measured again on
);
CREATE INDEX IF NOT EXISTS memory_entries_by_user ON memory_entries (tenant, user_id, status);
CREATE INDEX IF NOT EXISTS memory_entries_by_rev ON memory_entries (rev);

-- The memory turned off at run time (`clawr1 memory off`): for one user, or (`user_id` '') a
-- whole tenant; `off` 0 once turned on again. `rev` as the entries'.
CREATE TABLE IF NOT EXISTS memory_switches (
    tenant TEXT NOT NULL,
    user_id TEXT NOT NULL,
    off INTEGER NOT NULL,
    updated_at REAL NOT NULL,
    rev INTEGER NOT NULL,
    PRIMARY KEY (tenant, user_id)
);
CREATE INDEX IF NOT EXISTS memory_switches_by_rev ON memory_switches (rev);

-- What each tenant's steps take (schema v4): the characters and bytes of their stored fields, kept
-- in the transaction that stores them, so the gateway's storage quota reads one small row.
CREATE TABLE IF NOT EXISTS tenant_usage (
    tenant TEXT PRIMARY KEY,
    bytes INTEGER NOT NULL
);
"""

STEP_COLUMNS = ("step_id", "tenant", "session_id", "prompt_id", "turn_index", "turn_type", "policy_version",
                "adapter", "finish_reason", "temperature", "top_p", "top_k", "created_at", "messages", "tools", "text",
                "prompt_ids", "token_ids", "logprobs", "timings", "memory")
INSERT_STEP = f"INSERT INTO steps ({', '.join(STEP_COLUMNS)}) VALUES"  # + one (?, ...) group per row


# Columns added to a table after it first shipped, in SQLite's spelling: an older pool gets them
# before the schema script runs (its indexes may use them). A table it lacks is created whole.
ADDED_COLUMNS = (
    ("steps", "top_p", "REAL NOT NULL DEFAULT 1.0"),
    ("steps", "top_k", "INTEGER NOT NULL DEFAULT 0"),
    ("steps", "memory", "TEXT"),
    ("sessions", "key_hash", "TEXT"),
    ("samples", "shard_key", "INTEGER NOT NULL DEFAULT 0"),
    ("samples", "judge_attempts", "INTEGER NOT NULL DEFAULT 0"),
    ("samples", "judge_error", "TEXT"),
    ("samples", "judge_retry_at", "REAL"),
    ("samples", "judge_gave_up_at", "REAL"),
)


def shard_key(step_id: str) -> int:
    """A step's judge shard key: with n judge workers, worker i judges the turns whose key % n == i.
    Computed here, once, at insert (SQLite has no hash function in SQL to compute it in a query);
    31 bits, so it fits PostgreSQL's INTEGER too."""
    return zlib.crc32(step_id.encode()) & 0x7FFF_FFFF


# A step's stored size, as `row_bytes` counts it at insert, in SQL (for the steps of an older file).
STEP_BYTES_SQL = ("length(step_id) + length(messages) + coalesce(length(tools), 0) + length(text) + length(prompt_ids) "
                  "+ length(token_ids) + length(logprobs) + length(timings) + coalesce(length(memory), 0)")


_COUNTED = tuple(STEP_COLUMNS.index(c) for c in ("step_id", "messages", "tools", "text", "prompt_ids", "token_ids",
                                                 "logprobs", "timings", "memory"))


def row_bytes(row: tuple) -> int:
    """What a step row (`step_row`) takes in the pool, as `STEP_BYTES_SQL` counts it: the length of
    each text (in characters, as SQL's `length`) and blob it stores; small columns are not counted."""
    return sum(len(row[i]) for i in _COUNTED if row[i] is not None)


def count_usage(conn: Any) -> None:
    """Fill `tenant_usage` from the steps a pool holds (it was just created, on an older file)."""
    conn.execute(f"INSERT INTO tenant_usage (tenant, bytes) SELECT tenant, sum({STEP_BYTES_SQL}) FROM steps "
                 "GROUP BY tenant")


def add_columns(conn: Any, columns_of: Callable[[str], set[str]], spell: Callable[[str], str] = str) -> bool:
    """Bring an older pool's tables up to this schema (inside the caller's transaction): add the
    columns of `ADDED_COLUMNS` it lacks (`columns_of(table)`: its columns, empty when it has no such
    table; `spell`: a column type in the backend's spelling) and give old samples their shard keys.
    True when the pool has steps but no `tenant_usage` yet: `count_usage` once the schema exists."""
    for table, column, kind in ADDED_COLUMNS:
        present = columns_of(table)
        if present and column not in present:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {spell(kind)}")
            if column == "shard_key":
                ids = [row[0] for row in conn.execute("SELECT step_id FROM samples").fetchall()]
                conn.executemany("UPDATE samples SET shard_key = ? WHERE step_id = ?", [(shard_key(i), i) for i in ids])
    return bool(columns_of("steps")) and not columns_of("tenant_usage")


def connect(path: Path, config: PoolConfig) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit BEGIN IMMEDIATE ... COMMIT).

    WAL lets readers (stats, the CLI, another process) run while the writer commits.

    Why an acknowledged write survives SIGKILL: the writer acknowledges only after COMMIT returns,
    and in WAL mode COMMIT returns only after the transaction's frames, commit marker included,
    were handed to the kernel with write(). A killed process loses its memory, not the kernel's
    page cache, so the next opener finds the frames in the WAL and recovers them; that holds for
    both NORMAL and FULL. We default to FULL, which also fsyncs the WAL at each commit so a power
    cut or kernel crash cannot lose an acknowledged step either; group commit pays that one fsync
    for a whole batch. NORMAL (`pool.synchronous`) skips it: it is as safe against process crashes
    and only trades away the machine-crash guarantee.
    """
    conn = sqlite3.connect(path, timeout=config.busy_timeout_s, isolation_level=None, check_same_thread=False)
    # Only takes effect when the file is created. A step row is ~3 KB and more with long prompts:
    # on 4 KB pages nearly every row needs a page of its own; 16 KB pages measured ~1.5x faster.
    conn.execute("PRAGMA page_size=16384")
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if mode != "wal":
        raise RuntimeError(f"{path}: could not enable WAL (journal_mode is {mode})")
    conn.execute(f"PRAGMA synchronous={config.synchronous}")
    return conn


def _statements(script: str) -> list[str]:
    """Split a script into statements (a trigger body holds `;` too)."""
    statements, buffer = [], ""
    for piece in script.split(";"):
        buffer += piece + ";"
        if sqlite3.complete_statement(buffer):
            if buffer.strip(" \n;"):
                statements.append(buffer)
            buffer = ""
    return statements


def ensure_schema(conn: sqlite3.Connection) -> None:
    """Create the tables once, upgrade an older file's (`add_columns`); refuse a file written by a
    newer schema."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(f"pool schema v{version} is newer than this clawr1 (v{SCHEMA_VERSION})")
        older = add_columns(conn, lambda table: {row[1] for row in conn.execute(f"PRAGMA table_info({table})")})
        for statement in _statements(SCHEMA):
            conn.execute(statement)
        if older:
            count_usage(conn)
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:  # some errors (disk full, I/O) already rolled back
            conn.execute("ROLLBACK")
        raise


def pack_ints(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def pack_floats(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}d", *values)


def _unpack(code: str, blob: bytes) -> list:
    return list(struct.unpack(f"<{len(blob) // struct.calcsize(code)}{code}", blob))


# JSONEncoder.encode builds a new C encoder on every call (~3 µs, as much as encoding a small
# dict); this one is built once. Like json.dumps(ensure_ascii=False, separators=(",", ":")), but
# without the circular-reference check (a cycle is a RecursionError, not a ValueError).
_c_encoder = json.encoder.c_make_encoder and json.encoder.c_make_encoder(
    None, json.JSONEncoder().default, json.encoder.encode_basestring, None, ":", ",", False, False, True)
_py_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # where there is no C encoder


def dumps(value: Any) -> str:
    return "".join(_c_encoder(value, 0)) if _c_encoder else _py_encode(value)


def next_state_of(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages after the last assistant reply in a request: what the user, a tool or the
    environment answered. A client that resends no history gives its non-system messages."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            return messages[i + 1:]
    return [m for m in messages if m.get("role") not in ("system", "developer")]


def step_row(step: Step) -> tuple:
    """The INSERT parameters for a step (encoded in the caller's thread, off the writer's)."""
    return (step.step_id, step.tenant, step.session_id, step.prompt_id, step.turn_index, step.turn_type,
            step.policy_version, step.adapter, step.finish_reason, step.temperature, step.top_p, step.top_k, step.created_at,
            dumps(step.messages), None if step.tools is None else dumps(step.tools), step.text,
            pack_ints(step.prompt_ids), pack_ints(step.token_ids), pack_floats(step.logprobs), dumps(step.timings),
            None if step.memory is None else dumps(step.memory))


def row_step(row: sqlite3.Row, next_messages: str | None = None) -> Step:
    """A stored row back to a Step; `next_messages` is the linked next main turn's messages (JSON),
    from which its `next_state` is derived."""
    return Step(
        step_id=row["step_id"], tenant=row["tenant"], session_id=row["session_id"], prompt_id=row["prompt_id"],
        turn_index=row["turn_index"], turn_type=row["turn_type"], messages=json.loads(row["messages"]),
        tools=None if row["tools"] is None else json.loads(row["tools"]),
        prompt_ids=_unpack("i", row["prompt_ids"]), token_ids=_unpack("i", row["token_ids"]),
        logprobs=_unpack("d", row["logprobs"]), text=row["text"], policy_version=row["policy_version"],
        adapter=row["adapter"], finish_reason=row["finish_reason"], temperature=row["temperature"],
        top_p=row["top_p"], top_k=row["top_k"],
        created_at=row["created_at"], timings=json.loads(row["timings"]),
        next_state=None if next_messages is None else next_state_of(json.loads(next_messages)),
        memory=None if row["memory"] is None else json.loads(row["memory"]),
    )
