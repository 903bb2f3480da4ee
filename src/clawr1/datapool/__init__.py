"""The data pool: a durable, append-only log of steps, rewards, hints and session events, and the
queue of samples the trainer leases. `SQLitePool` is the embedded implementation; `PostgresPool`
(`clawr1.datapool.postgres`) the shared one. `open_pool(config)` opens whichever is configured."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from clawr1.datapool.base import (
    DataPool,
    PoolFullError,
    PoolQueue,
    PoolReadModel,
    UnknownLeaseError,
    UnknownSessionError,
    UnknownStepError,
)
from clawr1.datapool.sqlite import POOL_FILE, SQLitePool

if TYPE_CHECKING:
    from clawr1.core.config import Config


def open_existing_pool(config: Config) -> DataPool:
    """`open_pool` for a command that only reads (stats, show, export): where there is no pool
    (a mistyped `--data-dir`) it raises FileNotFoundError instead of creating an empty one."""
    if config.pool.backend == "sqlite" and not (Path(config.data_dir) / POOL_FILE).exists():
        raise FileNotFoundError(f"no data pool at {config.data_dir} ({POOL_FILE} is missing): check --data-dir")
    return open_pool(config)


def open_pool(config: Config) -> DataPool:
    """The pool `config.pool.backend` names (`config`: the whole `Config`, for the data dir)."""
    pool_config = config.pool
    if config.gateway.durable_reply:
        # Every append then has a client waiting on its commit: lingering for company would add
        # its wait to each reply (2.9 -> 0.75 ms p50 at one client without it, measured); appends
        # already queued still share a transaction.
        pool_config = pool_config.model_copy(update={"commit_linger_ms": 0.0})
    if config.pool.backend == "postgres":
        if not config.pool.postgres_dsn:
            raise ValueError('pool.backend = "postgres" needs pool.postgres_dsn')
        from clawr1.datapool.postgres import PostgresPool

        return PostgresPool(config.pool.postgres_dsn, pool_config)
    return SQLitePool(config.data_dir, pool_config)


__all__ = [
    "POOL_FILE",
    "DataPool",
    "PoolFullError",
    "PoolQueue",
    "PoolReadModel",
    "SQLitePool",
    "UnknownLeaseError",
    "UnknownSessionError",
    "UnknownStepError",
    "open_existing_pool",
    "open_pool",
]
