"""A real PostgreSQL server for the pool's tests, started once per test session by the test run
itself (Debian's `postgresql` package: `bash scripts/install.sh --test` installs it), on 127.0.0.1
and a free port, in a temporary data directory; each test gets a fresh schema."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.gateway_helpers import free_port

BIN = Path("/usr/lib/postgresql")


def _bin(name: str) -> str | None:
    found = sorted(BIN.glob(f"*/bin/{name}"))
    return str(found[-1]) if found else shutil.which(name)


class PostgresServer:
    def __init__(self) -> None:
        initdb, self.pg_ctl = _bin("initdb"), _bin("pg_ctl")
        if initdb is None or self.pg_ctl is None:
            pytest.skip("no PostgreSQL server binaries: install Debian's postgresql (bash scripts/install.sh --test)")
        self.dir = Path(tempfile.mkdtemp(prefix="clawr1-pg-"))
        self.port = free_port()
        # PostgreSQL refuses to run as root: as root, the server runs as the `postgres` user.
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.dir, "postgres")
        self._run(initdb, "-D", str(self.dir / "data"), "--auth=trust", "--username=clawr1", "--encoding=UTF8",
                  "--locale=en_US.UTF-8" if _has_locale("en_US.utf8") else "--locale=C.UTF-8")
        self._run(self.pg_ctl, "-D", str(self.dir / "data"), "-l", str(self.dir / "log"), "-w", "-o",
                  f"-h 127.0.0.1 -p {self.port} -k {self.dir} -c fsync=on -c max_connections=200", "start")
        self.dsn = f"host=127.0.0.1 port={self.port} user=clawr1 dbname=postgres"

    def _run(self, *args: str) -> None:
        done = subprocess.run([*self.as_user, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{args[0]} failed: {done.stderr[-2000:]}{done.stdout[-1000:]}"

    def fresh(self) -> str:
        """A DSN whose tables live in a new, empty schema."""
        import psycopg

        schema = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        return f"{self.dsn} options='-c search_path={schema}'"

    def stop(self) -> None:
        subprocess.run([*self.as_user, self.pg_ctl, "-D", str(self.dir / "data"), "-m", "fast", "-w", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)


def _has_locale(name: str) -> bool:
    done = subprocess.run(["locale", "-a"], capture_output=True, text=True)
    return name in done.stdout.lower()
