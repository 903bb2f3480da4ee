"""The data pool on PostgreSQL: the same ops and queries as the SQLite file, for several gateways
and trainers on several hosts sharing one pool (`pool.backend = "postgres"`, `pool.postgres_dsn`).

What changes on a server shared by many writers:
- write transactions are SERIALIZABLE: the ops read, then write (a step's neighbours before its
  next-state links, a reward's rank before it applies), so two gateways writing the same session
  must not interleave; PostgreSQL aborts the loser, and the group-commit writer runs it again;
- leases take their rows `FOR UPDATE SKIP LOCKED`: two trainers leasing at once get disjoint
  batches instead of waiting on each other;
- an acknowledged write is committed on the server (with its default `synchronous_commit = on`,
  flushed to its WAL), so it survives the gateway and the database server restarting alike.

`PgConnection` gives the ops the slice of `sqlite3.Connection` they use, so the SQL stays one text.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from clawr1.core.config import PoolConfig
from clawr1.datapool.schema import SCHEMA, SCHEMA_VERSION, _statements, add_columns, count_usage
from clawr1.datapool.sql import SQLPool

try:
    import psycopg
    from psycopg import errors as pg_errors
except ImportError as error:  # an optional extra: the embedded pool needs nothing
    raise ImportError("the PostgreSQL pool needs psycopg: pip install 'clawr1[postgres]'") from error

MAX_PARAMS = 65_535  # PostgreSQL's bound-parameter limit per statement (SQLite's is 32,766)
_SCHEMA_LOCK = 7_270_001  # advisory lock id: gateways starting at once create the schema once


def postgres_schema() -> list[str]:
    """SQLite's schema in PostgreSQL's types. Steps get a `rowid` (insertion order, as SQLite's
    implicit one) and a byte-order collation on `step_id`, whose range scans (`<id>-0`, `<id>-1`,
    ... up to `<id>.`) assume '-' < '.', which a language collation may not."""
    text = SCHEMA
    for old, new in (("step_id TEXT PRIMARY KEY,\n    tenant", 'rowid BIGSERIAL,\n    step_id TEXT COLLATE "C" PRIMARY KEY,\n    tenant'),
                     ("REAL", "DOUBLE PRECISION"), ("BLOB", "BYTEA"), ("id INTEGER PRIMARY KEY", "id BIGSERIAL PRIMARY KEY"),
                     (") WITHOUT ROWID;", ");"), ("DROP TRIGGER IF EXISTS step_stored;", "")):
        assert old in text, f"the SQLite schema changed: {old!r} is gone; update postgres_schema()"
        text = text.replace(old, new, 1 if old.startswith("step_id") else -1)
    return [*_statements(text), "CREATE TABLE IF NOT EXISTS clawr1_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"]


class Row(tuple):
    """A result row readable by index and by column name, as `sqlite3.Row` is."""

    __slots__ = ()
    _index: dict[str, int] = {}

    def __getitem__(self, key: Any) -> Any:
        return tuple.__getitem__(self, self._index[key] if isinstance(key, str) else key)

    def keys(self) -> Any:
        return self._index.keys()


def _rows(cursor: Any) -> Any:
    names = [column.name for column in cursor.description or ()]
    return type("Row", (Row,), {"__slots__": (), "_index": {n: i for i, n in enumerate(names)}})


@functools.lru_cache(maxsize=1024)
def _translate(sql: str) -> tuple[str, bool]:
    """SQLite's `?` / `?N` placeholders as psycopg's `%s` / `%(pN)s` (a literal `%` doubled); the
    writer's BEGIN IMMEDIATE as a serializable transaction, a reader's BEGIN as a read-only snapshot."""
    if sql == "BEGIN IMMEDIATE":
        return "BEGIN ISOLATION LEVEL SERIALIZABLE", False
    if sql == "BEGIN":
        return "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY", False
    sql = sql.replace("%", "%%")
    if re.search(r"\?\d", sql):
        return re.sub(r"\?(\d+)", r"%(p\1)s", sql), True
    return sql.replace("?", "%s"), False


class Cursor:
    """A statement's result as `sqlite3.Cursor` gives it: a statement without rows fetches none."""

    __slots__ = ("_cursor",)

    def __init__(self, cursor: Any):
        self._cursor = cursor

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount

    def fetchone(self) -> Any:
        return self._cursor.fetchone() if self._cursor.description else None

    def fetchall(self) -> list[Any]:
        return self._cursor.fetchall() if self._cursor.description else []

    def __iter__(self) -> Any:
        return iter(self.fetchall())


def _storable(value: Any) -> Any:
    """PostgreSQL's text cannot hold NUL, which SQLite's can (a reply, a correction, an id a client
    sent): it is stored as U+FFFD, so the write succeeds on both backends (the step's token ids,
    what trains, are exact either way) and a lookup by such an id finds nothing, as it would."""
    return value.replace("\x00", "\ufffd") if isinstance(value, str) and "\x00" in value else value


class PgConnection:
    """The part of `sqlite3.Connection` the pool's ops use, over a psycopg connection."""

    def __init__(self, conn: Any):
        self._conn = conn
        self.total_changes = 0
        """Rows inserted, updated or deleted on this connection, as `sqlite3.Connection`'s (the
        group-commit writer tells a commit that stored something from an empty one by it)."""

    def execute(self, sql: str, params: Any = ()) -> Cursor:
        query, named = _translate(sql)
        cursor = self._conn.cursor()
        params = [_storable(v) for v in params]
        cursor.execute(query, {f"p{i}": v for i, v in enumerate(params, 1)} if named else tuple(params))
        self._count(cursor)
        return Cursor(cursor)

    def executemany(self, sql: str, rows: Any) -> Cursor:
        query, named = _translate(sql)
        cursor = self._conn.cursor()
        rows = [[_storable(v) for v in r] for r in rows]
        cursor.executemany(query, [{f"p{i}": v for i, v in enumerate(r, 1)} if named else tuple(r) for r in rows])
        self._count(cursor)
        return Cursor(cursor)

    def _count(self, cursor: Any) -> None:
        if cursor.description is None and cursor.rowcount > 0:  # no result rows: INSERT, UPDATE, DELETE
            self.total_changes += cursor.rowcount

    def getlimit(self, _: int) -> int:
        return MAX_PARAMS

    @property
    def in_transaction(self) -> bool:
        return self._conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE

    def close(self) -> None:
        self._conn.close()


class PostgresPool(SQLPool):
    """`DataPool` on a PostgreSQL database (`dsn`: a libpq connection string or URL)."""

    def __init__(self, dsn: str, config: PoolConfig | None = None):
        self.dsn = dsn
        super().__init__(config)

    def _connect(self, write: bool) -> PgConnection:
        conn = PgConnection(psycopg.connect(self.dsn, autocommit=True, row_factory=_rows,
                                            connect_timeout=max(1, int(self.config.busy_timeout_s))))
        if write:
            ensure_schema(conn)
        return conn

    def _db_bytes(self) -> int:
        with self._read_lock:
            row = self._reader.execute(
                "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c JOIN pg_namespace n "
                "ON n.oid = c.relnamespace WHERE n.nspname = current_schema() AND c.relkind = 'r'").fetchone()
        return int(row[0])

    def _retryable(self, error: BaseException) -> bool:
        return isinstance(error, (pg_errors.SerializationFailure, pg_errors.DeadlockDetected))

    def _unavailable(self, error: BaseException) -> bool:
        # The server's disk full, out of memory, shutting down, or the connection lost.
        return isinstance(error, (psycopg.OperationalError, OSError))

    def _touch(self, conn: PgConnection) -> None:
        # A new version of one tiny row: a WAL record the server must flush at COMMIT.
        conn.execute("UPDATE clawr1_meta SET value = value WHERE key = 'schema_version'")


def ensure_schema(conn: PgConnection) -> None:
    """Create the tables once (under an advisory lock), upgrade an older database's (`add_columns`);
    refuse a database of a newer schema. Read committed, not serializable: a gateway that waited on
    the lock must see what the first created."""
    conn.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
    try:
        conn.execute(f"SELECT pg_advisory_xact_lock({_SCHEMA_LOCK})")
        conn.execute("CREATE TABLE IF NOT EXISTS clawr1_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        row = conn.execute("SELECT value FROM clawr1_meta WHERE key = 'schema_version'").fetchone()
        if row is not None and int(row[0]) > SCHEMA_VERSION:
            raise RuntimeError(f"pool schema v{row[0]} is newer than this clawr1 (v{SCHEMA_VERSION})")
        older = add_columns(conn, functools.partial(_columns, conn), lambda kind: kind.replace("REAL", "DOUBLE PRECISION"))
        for statement in postgres_schema():
            conn.execute(statement)
        if older:
            count_usage(conn)
        conn.execute("INSERT INTO clawr1_meta (key, value) VALUES ('schema_version', ?) ON CONFLICT (key) "
                     "DO UPDATE SET value = excluded.value", (str(SCHEMA_VERSION),))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _columns(conn: PgConnection, table: str) -> set[str]:
    """A table's columns in the pool's schema (empty if it has no such table)."""
    rows = conn.execute("SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema() "
                        "AND table_name = ?", (table,)).fetchall()
    return {row[0] for row in rows}
