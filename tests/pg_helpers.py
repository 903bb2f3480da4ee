"""A real PostgreSQL server for the pool's tests (`clawr1.datapool.pgserver.LocalPostgres`), started
once per test session by the test run itself; a test is skipped, saying so, only where the server
binaries are missing (`bash scripts/install.sh --test` installs Debian's postgresql)."""

from __future__ import annotations

import pytest

from clawr1.datapool.pgserver import LocalPostgres, PostgresUnavailable


def start() -> LocalPostgres:
    try:
        return LocalPostgres()
    except PostgresUnavailable as exc:
        pytest.skip(f"{exc} (bash scripts/install.sh --test installs it)")
