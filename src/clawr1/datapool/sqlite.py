"""The embedded data pool: one SQLite file (`<data_dir>/pool.sqlite3`) in WAL mode (see `schema.connect`
for why an acknowledged write survives a crash). Several processes (gateway, trainer, CLI) may open
the same file: SQLite's lock serialises their write transactions, each waiting up to `busy_timeout_s`.

A full disk fails a commit with SQLITE_FULL and SQLite rolls it back: what was committed before is
untouched (the WAL's frames past the last commit marker are ignored on recovery), and the file
takes writes again as soon as there is room.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

from clawr1.core.config import PoolConfig
from clawr1.datapool.schema import SCHEMA_VERSION, connect, ensure_schema
from clawr1.datapool.sql import SQLPool

POOL_FILE = "pool.sqlite3"
# `check_writable` wants this much free space before it reports the pool writable again. A tiny
# write can succeed on a full disk (it may land in WAL space already allocated) while the next
# batch of steps (~3 KB each, 16 KB pages, several pages a commit) fails: without a margin, a
# gateway at the edge of a full disk would admit, lose and refuse in turn.
MIN_FREE_BYTES = 1 << 20


class SQLitePool(SQLPool):
    """`DataPool` on a SQLite file."""

    def __init__(self, data_dir: Path, config: PoolConfig | None = None):
        self.path = Path(data_dir) / POOL_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(config)

    def _connect(self, write: bool) -> sqlite3.Connection:
        conn = connect(self.path, self.config)
        if write:
            ensure_schema(conn)
        else:
            conn.row_factory = sqlite3.Row
        return conn

    def _unavailable(self, error: BaseException) -> bool:
        # Disk full, disk I/O error, database locked past the busy timeout, read-only file system.
        return isinstance(error, (sqlite3.OperationalError, OSError))

    def _touch(self, conn: sqlite3.Connection) -> None:
        # Rewrites the header page with the value it has: one WAL frame, no row changed.
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def check_writable(self) -> str | None:
        free = shutil.disk_usage(self.path.parent).free
        if free < MIN_FREE_BYTES:
            return f"{free} bytes free on the pool's file system (at {self.path.parent}); waiting for {MIN_FREE_BYTES}"
        return super().check_writable()

    def _db_bytes(self) -> int:
        files = (self.path, self.path.with_name(self.path.name + "-wal"))
        return sum(f.stat().st_size for f in files if f.exists())
