"""The data pool's settings: durability, group commit, leases, staleness."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from clawr1.core.config._base import _Section


class PoolConfig(_Section):
    backend: Literal["sqlite", "postgres"] = "sqlite"
    """Where the pool lives: `sqlite`, one file in the data dir (one machine); `postgres`, a
    PostgreSQL database (`postgres_dsn`) that gateways and trainers on several hosts share."""

    postgres_dsn: str | None = Field(None, min_length=1, max_length=4096)
    """libpq connection string or URL for `backend = "postgres"`, e.g.
    `postgresql://clawr1@db.internal/clawr1`. A secret (it may hold a password): never printed."""

    synchronous: Literal["FULL", "NORMAL"] = "FULL"
    """SQLite `synchronous` in WAL mode. FULL fsyncs the WAL at every commit, so an acknowledged
    write survives a process kill *and* a power cut; group commit pays that fsync once per batch.
    NORMAL skips the fsync: still safe against a killed process (the OS holds the written pages)
    but the last commits can be lost if the machine itself goes down."""

    group_commit_max: int = Field(1024, ge=1, le=100_000)
    """Most queued writes committed together in one transaction (one fsync for all of them)."""

    commit_linger_ms: float = Field(2.0, ge=0, le=1000)
    """A lone step append waits this long for others to share its transaction (one fsync for
    all); 0 commits every append at once. With `gateway.durable_reply` on (a client waits on each
    append's commit) every pool `open_pool` opens uses 0: only step appends ever linger."""

    writer_queue: int = Field(65_536, ge=1, le=10_000_000)
    """Writes waiting for the writer thread before new ones are refused with `PoolFullError`
    (the gateway turns that into a 429 instead of losing data silently)."""

    busy_timeout_s: float = Field(10.0, gt=0, le=600)
    """How long a transaction waits for another process (the trainer, the CLI) holding the write
    lock before failing."""

    lease_seconds: float = Field(600.0, gt=0, le=86_400)
    """How long a trainer holds leased samples; unacknowledged samples return to READY after it,
    so a trainer crash loses nothing and nothing is consumed twice."""

    max_lease_attempts: int = Field(3, ge=1, le=1000)
    """How many times a sample's training may fail (its lease expired unacknowledged, or the
    trainer gave it back: out of memory, a non-finite gradient) before it is dropped as `poison`
    (`clawr1 pool stats` and the dashboard count it among the drop reasons; each failure is an
    event of its session, with why). Without a limit, a sample that kills the trainer came back
    after every restart and killed it again."""

    max_staleness: int = Field(4, ge=0, le=1_000_000)
    """Default bound on how many policy versions a leased sample may lag the trainer's version."""

    stale_policy: Literal["drop", "downweight"] = "drop"
    """What happens to samples beyond the staleness bound: dropped (reason `stale`), or still
    leased with weight `stale_weight` (and reason `stale` recorded)."""

    stale_weight: float = Field(0.1, gt=0, le=1)
    """Loss weight of a stale sample under `stale_policy = "downweight"`."""

    fresh_fraction: float = Field(0.75, ge=0, le=1)
    """Target share of each lease taken from fresh (on-policy: produced by the current version)
    samples; the rest comes from older versions within the bound. Either kind fills in for the
    other when short, so a lease is never smaller than what is READY."""
