"""The data pool: a durable, append-only log of steps, rewards, hints and session events, and the
queue of samples the trainer leases. `SQLitePool` is the embedded implementation."""

from clawr1.datapool.base import (
    DataPool,
    PoolFullError,
    UnknownLeaseError,
    UnknownSessionError,
    UnknownStepError,
)
from clawr1.datapool.sqlite import POOL_FILE, SQLitePool

__all__ = [
    "POOL_FILE",
    "DataPool",
    "PoolFullError",
    "SQLitePool",
    "UnknownLeaseError",
    "UnknownSessionError",
    "UnknownStepError",
]
