"""Group commit: one writer thread turns many queued writes into one transaction and one fsync.

Callers (gateway handlers, the reward stage, the trainer) submit a write and get a `Future`; the
writer drains whatever is queued, runs it all inside one BEGIN IMMEDIATE ... COMMIT, and only then
resolves the futures. So an acknowledged write is a committed one, and 1,000 concurrent appends
cost one fsync instead of 1,000.

A write is `(op, arg)` where `op(conn, [arg, ...])` returns one result per arg: consecutive writes
with the same op run as one call, so a batch of appends becomes a handful of multi-row statements
instead of a Python loop of single statements. Each statement (and each row fetched) hands the GIL
back and forth, and while callers encode steps each reacquisition can wait a switch interval.

A failed commit (disk full, I/O error, a lock held too long) fails only its own batch: the writer
reports the error to that batch's futures and keeps running, and `failure()` says why the pool
cannot write until a commit that stores something (or a `check`) succeeds again. The gateway
refuses new requests meanwhile instead of answering ones whose steps would be lost.
"""

from __future__ import annotations

import logging
import queue
import random
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from itertools import groupby
from typing import Any

from clawr1.datapool.base import PoolFullError

BatchOp = Callable[[sqlite3.Connection, list[Any]], list[Any]]
_STOP = object()
log = logging.getLogger(__name__)


def run_each(conn: sqlite3.Connection, fns: list[Callable[[sqlite3.Connection], Any]]) -> list[Any]:
    """The batch op for writes that are not batched: call each `fn(conn)` in turn."""
    return [fn(conn) for fn in fns]


def run_check(conn: sqlite3.Connection, fns: list[Callable[[sqlite3.Connection], Any]]) -> list[Any]:
    """The batch op of `GroupCommitWriter.check`: `run_each`, under a name of its own so the writer
    knows its commit proves the pool writable even though it may change no row."""
    return [fn(conn) for fn in fns]


class GroupCommitWriter:
    """Owns the write connection; everything that changes the pool in this process goes through it."""

    def __init__(self, conn: sqlite3.Connection, max_batch: int, max_queue: int, linger_s: float = 0.0,
                 linger_ops: tuple[BatchOp, ...] = (), retryable: Callable[[BaseException], bool] | None = None,
                 unavailable: Callable[[BaseException], bool] | None = None):
        """`retryable(error)`: the batch lost a conflict and runs again. `unavailable(error)`: an
        error raised inside a write that is the database's, not that write's (disk full, I/O), so
        it fails the whole batch and `failure()` reports it; a failed BEGIN or COMMIT always is."""
        self._conn = conn
        self._retryable = retryable or (lambda error: False)
        self._unavailable = unavailable or (lambda error: False)
        self._failure: str | None = None  # why the last commit failed; None once one stored something again
        self._max_batch = max_batch
        self._linger_s, self._linger_ops = linger_s, linger_ops
        self._queue: queue.Queue = queue.Queue(max_queue)
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="clawr1-pool-writer", daemon=True)
        self._thread.start()

    def submit(self, op: BatchOp, arg: Any) -> Future:
        """Queue one write; its future resolves with its result after COMMIT (or with its error)."""
        future: Future = Future()
        with self._lock:  # so nothing is queued behind the stop marker and left unresolved
            if self._closed:
                raise RuntimeError("the data pool is closed")
            try:
                self._queue.put_nowait((op, arg, future))
            except queue.Full:
                raise PoolFullError(f"pool write queue full ({self._queue.maxsize} waiting)") from None
        return future

    def pending(self) -> int:
        """Writes waiting for the writer thread (approximate, like `Queue.qsize`)."""
        return self._queue.qsize()

    def capacity(self) -> int:
        return self._queue.maxsize

    def run(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        """Run one unbatched write `fn(conn)` in the next commit and wait for it."""
        return self.submit(run_each, fn).result()

    def failure(self) -> str | None:
        """Why the last commit failed (`"OperationalError: database or disk is full"`), or None.
        Cleared by the next commit that changed a row, or by a successful `check`: a commit that
        wrote nothing (an idle sweep that found nothing to close) proves nothing about the disk.
        One attribute read, so the gateway can ask on every request."""
        return self._failure

    def check(self, fn: Callable[[sqlite3.Connection], Any]) -> None:
        """Commit the tiny write `fn(conn)` now and wait; its success clears `failure()`, its
        error is raised. The half-open probe of a gateway refusing requests while the pool cannot
        write."""
        self.submit(run_check, fn).result()

    def close(self) -> None:
        """Commit everything queued so far, then stop the thread and close the connection."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)  # FIFO: every write submitted before close is committed first
        self._thread.join()
        self._conn.close()

    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch = [self._queue.get()]
            # Appends may wait `linger_s` for company: at low load each would otherwise be a
            # transaction of its own (~0.8 ms of CPU and an fsync each, against ~0.1 ms a step in
            # a group). Nobody waits on an append's reply for it: the gateway answers first.
            lingers = batch[0] is not _STOP and batch[0][0] in self._linger_ops
            deadline = time.monotonic() + (self._linger_s if lingers else 0.0)
            while len(batch) < self._max_batch and batch[-1] is not _STOP:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    try:
                        batch.append(self._queue.get(timeout=left))
                    except queue.Empty:
                        break
            if batch[-1] is _STOP:
                batch.pop()
                stopping = True
            # A future cancelled before it ran (e.g. its asyncio waiter was cancelled) is skipped.
            batch = [item for item in batch if item[2].set_running_or_notify_cancel()]
            if batch:
                self._commit(batch)

    def _commit(self, batch: list[tuple[BatchOp, Any, Future]], attempt: int = 0) -> None:
        conn = self._conn
        in_op = False
        try:
            if conn.in_transaction:  # a ROLLBACK that failed last time (`_rollback`): end it first
                conn.execute("ROLLBACK")
            changes = conn.total_changes
            conn.execute("BEGIN IMMEDIATE")
            in_op = True
            results: list[Any] = []
            for op, group in groupby(batch, key=lambda item: item[0]):
                results.extend(op(conn, [arg for _, arg, _ in group]))
            in_op = False
            conn.execute("COMMIT")
        except Exception as error:  # noqa: BLE001 - retried, or delivered to each write's future below
            self._rollback(error)
            if self._retryable(error) and attempt < 20:
                # A concurrent writer (another gateway on PostgreSQL) won a conflict: nothing of this
                # batch happened, so running it again is exact. Back off a little, with jitter.
                time.sleep(min(0.2, 0.002 * 2 ** attempt) * (0.5 + random.random()))
                self._commit(batch, attempt + 1)
                return
            shared = not in_op or (self._unavailable(error) and not self._retryable(error))
            if not shared and len(batch) > 1:
                # One bad write must not fail its neighbours: retry each alone, so only it fails.
                # (A failed BEGIN or COMMIT, or the disk failing inside a write, is shared: retrying
                # each alone would fail each again, one transaction at a time.)
                for item in batch:
                    self._commit([item])
                return
            if shared:
                if self._failure is None:
                    log.error("the data pool cannot write (%s: %s): a batch of %d writes failed; the pool "
                              "reports it until a commit stores something again", type(error).__name__, error,
                              len(batch))
                self._failure = f"{type(error).__name__}: {error}"
            for _, _, future in batch:
                future.set_exception(error)
            return
        if self._failure is not None and (conn.total_changes != changes or any(op is run_check for op, _, _ in batch)):
            log.warning("the data pool writes again (it failed with %s)", self._failure)
            self._failure = None
        for (_, _, future), result in zip(batch, results, strict=True):
            future.set_result(result)

    def _rollback(self, error: Exception) -> None:
        """End the failed transaction. SQLite already rolled back after a full disk or an I/O error
        in COMMIT; a ROLLBACK that fails too is noted on the error the batch gets, and must not end
        the writer: the next batch's BEGIN tries again."""
        if not self._conn.in_transaction:
            return
        try:
            self._conn.execute("ROLLBACK")
        except Exception as rollback_error:  # noqa: BLE001 - noted on the batch's error; the writer goes on
            error.add_note(f"and the ROLLBACK failed: {type(rollback_error).__name__}: {rollback_error}")
