"""A throwaway PostgreSQL server on 127.0.0.1 for the pool's tests and benchmarks: `initdb` into a
temporary directory, `pg_ctl start` on a free port (as the `postgres` user when run as root, since
PostgreSQL refuses root), trust auth on loopback, removed on `stop()`. Debian's `postgresql`
package provides the binaries. Not for production: point `pool.postgres_dsn` at a real server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

BIN = Path("/usr/lib/postgresql")


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server binaries on this machine."""


def _bin(name: str) -> str | None:
    found = sorted(BIN.glob(f"*/bin/{name}"))
    return str(found[-1]) if found else shutil.which(name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalPostgres:
    def __init__(self) -> None:
        initdb, self.pg_ctl = _bin("initdb"), _bin("pg_ctl")
        if initdb is None or self.pg_ctl is None:
            raise PostgresUnavailable("no PostgreSQL server binaries: install Debian's postgresql")
        self.dir = Path(tempfile.mkdtemp(prefix="clawr1-pg-"))
        self.port = _free_port()
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.dir, "postgres")
        self._run(initdb, "-D", str(self.dir / "data"), "--auth=trust", "--username=clawr1", "--encoding=UTF8",
                  "--locale=C.UTF-8")
        self._run(self.pg_ctl, "-D", str(self.dir / "data"), "-l", str(self.dir / "log"), "-w", "-o",
                  f"-h 127.0.0.1 -p {self.port} -k {self.dir} -c max_connections=200", "start")
        self.dsn = f"host=127.0.0.1 port={self.port} user=clawr1 dbname=postgres"

    def _run(self, *args: str) -> None:
        done = subprocess.run([*self.as_user, *args], capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{args[0]} failed: {done.stderr[-2000:]}{done.stdout[-1000:]}")

    def fresh(self) -> str:
        """A DSN whose tables live in a new, empty schema."""
        import psycopg

        schema = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        return f"{self.dsn} options='-c search_path={schema}'"

    def stop(self) -> None:
        subprocess.run([*self.as_user, self.pg_ctl, "-D", str(self.dir / "data"), "-m", "fast", "-w", "stop"],
                       capture_output=True, timeout=60, check=False)  # a server already gone is stopped
        shutil.rmtree(self.dir, ignore_errors=True)
