"""The data pool over one SQL database: every operation of the `DataPool` contract, shared by the
SQLite file (`sqlite.py`) and PostgreSQL (`postgres.py`).

Every change goes through this process's group-commit writer thread; reads use a separate
connection and never wait for it. Several processes (gateway, trainer, CLI; several gateways on
PostgreSQL) may use the same database: its locks serialise their write transactions.
"""

from __future__ import annotations

import threading
import uuid
from abc import abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

from clawr1.core.config import PoolConfig
from clawr1.core.records import DEFAULT_TENANT, Hint, Lease, Reward, Step
from clawr1.datapool import leases, ops, queries
from clawr1.datapool.base import DataPool, ExportFilter, ExportFormat
from clawr1.datapool.schema import step_row
from clawr1.datapool.writer import GroupCommitWriter, run_each


def _snapshot(conn: Any, fn: Any, *args: Any) -> Any:
    """Run a read inside one read transaction: every query of it sees the same committed state."""
    conn.execute("BEGIN")
    try:
        return fn(conn, *args)
    finally:
        conn.execute("COMMIT")  # ends a read transaction; nothing was written


class SQLPool(DataPool):
    """`DataPool` over one SQL database: the ops and queries are shared, a backend gives its
    connections (`_connect`), its size (`_db_bytes`) and which errors mean "run it again"
    (`_retryable`). Thread-safe; async callers wrap `submit_step`'s future."""

    def __init__(self, config: PoolConfig | None = None):
        self.config = config or PoolConfig()
        conn = self._connect(write=True)
        self._writer = GroupCommitWriter(conn, self.config.group_commit_max, self.config.writer_queue,
                                         self.config.commit_linger_ms / 1000, (ops.insert_steps,), self._retryable,
                                         self._unavailable)
        self._reader = self._connect(write=False)
        self._read_lock = threading.Lock()

    @abstractmethod
    def _connect(self, write: bool) -> Any:
        """A connection in autocommit mode (transactions are explicit), rows readable by name and
        index; the first writer connection also creates the schema."""

    @abstractmethod
    def _db_bytes(self) -> int:
        """The pool's size on disk."""

    def _retryable(self, error: BaseException) -> bool:
        """A transaction that failed only because a concurrent one won (PostgreSQL's serializable
        isolation): the writer runs it again. SQLite's single writer never needs to."""
        return False

    @abstractmethod
    def _unavailable(self, error: BaseException) -> bool:
        """An error inside a write that is the database's (disk full, I/O error, lost connection),
        not that write's (an unknown step id): it fails the whole batch and sets `write_error`."""

    @abstractmethod
    def _touch(self, conn: Any) -> None:
        """`check_writable`'s write: the smallest change this backend commits to disk, leaving the
        pool as it was."""

    # -- writing -------------------------------------------------------------------------------

    def submit_step(self, step: Step) -> Future[bool]:
        if not isinstance(step, Step):
            raise TypeError(f"expected a Step, got {type(step).__name__}")
        # Encoded here, in the caller's thread, so the single writer only runs SQL.
        return self._writer.submit(ops.insert_steps, step_row(step))

    def close_session(self, session_id: str, outcome_reward: float | None = None, *,
                      tenant: str = DEFAULT_TENANT, reason: str = "closed", step_weight: float = 0.0) -> bool:
        if outcome_reward is not None and not -1.0 <= outcome_reward <= 1.0:
            raise ValueError(f"outcome_reward must be in [-1, 1], got {outcome_reward}")
        if not 0.0 <= step_weight <= 1.0:
            raise ValueError(f"step_weight must be in [0, 1], got {step_weight}")
        return self._writer.run(partial(ops.close_session, tenant=tenant, session_id=session_id,
                                        outcome=outcome_reward, reason=reason, step_weight=step_weight))

    def open_session(self, session_id: str, *, tenant: str = DEFAULT_TENANT, key_hash: str | None = None) -> bool:
        if not session_id or not tenant:
            raise ValueError("session_id and tenant must be non-empty")
        return self._writer.run(partial(ops.open_session, tenant=tenant, session_id=session_id, key_hash=key_hash))

    def close_idle(self, idle_s: float, keep: Iterable[tuple[str, str]] = (),
                   mine: Callable[[str], bool] | None = None) -> list[tuple[str, str]]:
        return self._writer.run(partial(ops.close_idle, idle_before=ops.clock() - idle_s, keep=set(keep), mine=mine))

    def add_feedback(self, *, tenant: str = DEFAULT_TENANT, session_id: str | None = None,
                     turn_index: int | None = None, completion_id: str | None = None,
                     score: float | None = None, correction: str | None = None) -> list[str]:
        if (session_id is None) == (completion_id is None):
            raise ValueError("name exactly one of session_id or completion_id")
        if score is None and not (correction and correction.strip()):
            raise ValueError("feedback needs a score, a correction, or both")
        if score is not None and not -1.0 <= score <= 1.0:
            raise ValueError(f"score must be in [-1, 1], got {score}")
        return self._writer.run(partial(ops.add_feedback, tenant=tenant, session_id=session_id,
                                        turn_index=turn_index, completion_id=completion_id, score=score,
                                        correction=correction.strip() if correction else None))

    def submit_reward(self, reward: Reward) -> Future[None]:
        if not isinstance(reward, Reward):
            raise TypeError(f"expected a Reward, got {type(reward).__name__}")
        return self._writer.submit(run_each, partial(ops.add_reward, reward=reward))

    def submit_judgement(self, reward: Reward, hint: Hint | None) -> Future[None]:
        if not isinstance(reward, Reward) or not (hint is None or isinstance(hint, Hint)):
            raise TypeError(f"expected a Reward and a Hint or None, got {type(reward).__name__}, {type(hint).__name__}")
        if hint is not None and hint.step_id != reward.step_id:
            raise ValueError(f"the hint is for {hint.step_id}, the reward for {reward.step_id}")
        return self._writer.submit(run_each, partial(ops.add_judgement, reward=reward, hint=hint))

    def add_hint(self, hint: Hint) -> None:
        self._writer.run(partial(ops.add_hint, hint=hint))

    def mark_ready(self, step_id: str) -> bool:
        return self._writer.run(partial(ops.mark_ready, step_id=step_id))

    def forget_memory(self, entry_id: int | None = None, *, tenant: str | None = None,
                      user: str | None = None) -> list[int]:
        if entry_id is None and not (tenant and user):
            raise ValueError("name an entry id, or a tenant and a user")
        return self._writer.run(partial(ops.forget_memory, entry_id=entry_id, tenant=tenant, user=user))

    def check_memory(self, version: int, gaps: dict[int, dict[str, Any]], retire_gap: float, return_gap: float,
                     min_tokens: int, retire: bool = True, source: str = "trained") -> dict[str, list[int]]:
        return self._writer.run(partial(ops.check_memory, version=version, gaps=gaps, retire_gap=retire_gap,
                                        return_gap=return_gap, min_tokens=min_tokens, retire=retire, source=source))

    def memory_recheck(self, tenant: str | None = None, limit: int = 8) -> list[dict[str, Any]]:
        return self._read(queries.memory_recheck, tenant, limit)

    def switch_memory(self, tenant: str, user: str = "", off: bool = True) -> bool:
        if not tenant:
            raise ValueError("name the tenant")
        return self._writer.run(partial(ops.switch_memory, tenant=tenant, user=user, off=off))

    def memory_changes(self, entries_since: int = 0, switches_since: int = 0) -> dict[str, Any]:
        return self._read(queries.memory_changes, entries_since, switches_since)

    def judge_failed(self, step_id: str, error: str, max_attempts: int, retry_s: float) -> bool:
        if max_attempts < 1 or retry_s <= 0:
            raise ValueError(f"max_attempts must be >= 1 and retry_s > 0, got {max_attempts} and {retry_s}")
        return self._writer.run(partial(ops.judge_failed, step_id=step_id, error=error, max_attempts=max_attempts,
                                        retry_s=retry_s))

    def hold_out(self, tenant: str | None, n: int) -> list[str]:
        if n < 1:
            raise ValueError(f"hold out at least 1 turn, got {n}")
        return self._writer.run(partial(ops.hold_out, tenant=tenant, n=n))

    def record_version(self, adapter: str, version: int, status: str, reason: str, scores: dict[str, Any]) -> None:
        self._writer.run(partial(ops.record_version, adapter=adapter, version=version, status=status, reason=reason,
                                 scores=scores))

    # -- training ------------------------------------------------------------------------------

    def lease(self, n: int, max_staleness: int | None = None, current_version: int = 0,
              tenant: str | None = None) -> Lease:
        if n < 1:
            raise ValueError(f"lease size must be >= 1, got {n}")
        staleness = self.config.max_staleness if max_staleness is None else max_staleness
        if staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {staleness}")
        return self._writer.run(partial(leases.lease, lease_id=uuid.uuid4().hex, n=n, max_staleness=staleness,
                                        current_version=current_version, config=self.config, tenant=tenant))

    def ack(self, lease: Lease | str) -> int:
        if isinstance(lease, Lease):
            if not lease.step_ids:
                return 0  # an empty lease was never recorded
            lease = lease.lease_id
        return self._writer.run(partial(leases.ack, lease_id=lease, max_attempts=self.config.max_lease_attempts))

    def release(self, lease: Lease | str, failed: dict[str, str] | None = None) -> int:
        if isinstance(lease, Lease):
            if not lease.step_ids:
                return 0  # an empty lease was never recorded
            lease = lease.lease_id
        return self._writer.run(partial(leases.release, lease_id=lease, failed=dict(failed or {}),
                                        max_attempts=self.config.max_lease_attempts))

    def expire_leases(self) -> int:
        return self._writer.run(lambda conn: leases.expire_leases(conn, ops.clock(), self.config.max_lease_attempts))

    # -- reading -------------------------------------------------------------------------------

    def _read(self, fn: Any, *args: Any) -> Any:
        with self._read_lock:
            return _snapshot(self._reader, fn, *args)

    def get_steps(self, step_ids: Iterable[str]) -> list[Step]:
        return self._read(queries.get_steps, list(step_ids))

    def last_turn(self, session_id: str, tenant: str = DEFAULT_TENANT) -> int | None:
        return self._read(queries.last_turn, tenant, session_id)

    def session_by_key(self, key_hash: str) -> tuple[str, str, str] | None:
        return self._read(queries.session_by_key, key_hash)

    def ready_state(self, tenant: str | None = None) -> tuple[int, float | None]:
        return self._read(queries.ready_state, tenant)

    def ready_tenants(self) -> list[str]:
        return self._read(queries.ready_tenants)

    def hints(self, step_ids: Iterable[str]) -> dict[str, str]:
        return self._read(queries.hints, list(step_ids))

    def previous_turns(self, step_ids: Iterable[str]) -> dict[str, str]:
        return self._read(queries.previous_turns, list(step_ids))

    def unjudged(self, limit: int = 64, shard: tuple[int, int] = (0, 1)) -> list[str]:
        index, count = shard
        if not 0 <= index < count:
            raise ValueError(f"shard must be (i, n) with 0 <= i < n, got {shard}")
        return self._read(queries.unjudged, limit, (index, count), ops.clock())

    def pending_writes(self) -> int:
        return self._writer.pending()

    def write_error(self) -> str | None:
        return self._writer.failure()

    def check_writable(self) -> str | None:
        try:
            self._writer.check(self._touch)
        except Exception as error:  # noqa: BLE001 - the answer, as a value: the caller keeps refusing and asks again
            return f"{type(error).__name__}: {error}"
        return None

    def stats(self, tenant: str | None = None) -> dict[str, Any]:
        return {**self._read(queries.stats, tenant), "db_bytes": self._db_bytes()}

    def sessions(self, limit: int = 100, tenant: str | None = None) -> list[dict[str, Any]]:
        return self._read(queries.sessions, limit, tenant)

    def samples(self, limit: int = 50, status: str | None = None, tenant: str | None = None) -> list[dict[str, Any]]:
        return self._read(queries.samples, limit, status, tenant)

    def versions(self, tenant: str | None = None) -> list[dict[str, Any]]:
        return self._read(queries.versions, tenant)

    def policy_versions(self, adapter: str | None = None) -> list[dict[str, Any]]:
        return self._read(queries.policy_versions, adapter)

    def memory(self, tenant: str | None = None, user: str | None = None, status: str | None = None,
               limit: int = 100) -> list[dict[str, Any]]:
        return self._read(queries.memory_entries, tenant, user, status, limit)

    def memory_entry(self, entry_id: int, tenant: str | None = None) -> dict[str, Any]:
        return self._read(queries.memory_entry, entry_id, tenant)

    def memory_switches(self, tenant: str | None = None) -> list[dict[str, Any]]:
        return self._read(queries.memory_switches, tenant)

    def lease_ready_times(self, lease_ids: Iterable[str]) -> dict[str, list[float]]:
        return self._read(queries.lease_ready_times, list(lease_ids))

    def tenant_usage(self) -> dict[str, int]:
        return self._read(queries.tenant_usage)

    def show(self, ident: str, tenant: str | None = None, kind: Literal["step", "session"] | None = None) -> dict[str, Any]:
        return self._read(queries.show, ident, tenant, kind)

    def export(self, path: Path, format: ExportFormat = "jsonl", *, rewarded_only: bool = False,
               filters: ExportFilter | None = None) -> int:
        filters = filters or ExportFilter()
        if rewarded_only:
            filters = replace(filters, rewarded_only=True)
        # Its own connection: a long export must not hold the lock that stats() needs.
        conn = self._connect(write=False)
        try:
            return _snapshot(conn, queries.export, Path(path), format, filters)
        finally:
            conn.close()

    def close(self) -> None:
        self._writer.close()
        with self._read_lock:
            self._reader.close()
