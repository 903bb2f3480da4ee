"""The embedded data pool: one SQLite file (`<data_dir>/pool.sqlite3`) in WAL mode (see `schema.connect`
for why an acknowledged write survives a crash). Several processes (gateway, trainer, CLI) may open
the same file: SQLite's lock serialises their write transactions, each waiting up to `busy_timeout_s`.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from clawr1.core.config import PoolConfig
from clawr1.datapool.schema import connect, ensure_schema
from clawr1.datapool.sql import SQLPool

POOL_FILE = "pool.sqlite3"


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

    def _db_bytes(self) -> int:
        files = (self.path, self.path.with_name(self.path.name + "-wal"))
        return sum(f.stat().st_size for f in files if f.exists())
