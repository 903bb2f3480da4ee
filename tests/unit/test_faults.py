"""Faults: the pool's disk fills up under a live gateway, and the trainer dies mid-publish.

The disk-full tests put the pool on a real small tmpfs (mounting needs root; they skip, saying why,
where it is refused) and fill it with a file: SQLite fails its commits with SQLITE_FULL exactly as
on a real disk. What must hold: no reply is answered 200 whose step is then lost once the pool
knows it cannot write (503 `pool_unavailable` instead, with `durable_reply` on or off), nothing
committed before is damaged, and the gateway admits again by itself once there is room.

The publish test SIGKILLs a LoRA publisher (`tests/killable_publisher.py`) right after each file it
opens and at 24 random moments: every version directory must then be complete or unmarked, and
nothing unmarked is ever what `newest`/`latest` name or what the engine loads.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from clawr1.core.config import EngineConfig, PoolConfig
from clawr1.core.types import AdapterError
from clawr1.datapool import POOL_FILE, SQLitePool, UnknownStepError
from clawr1.datapool.writer import GroupCommitWriter, run_each
from clawr1.engine import adapters
from clawr1.engine.local import LocalEngine
from clawr1.gateway.service import Admission
from tests.conftest import run
from tests.gateway_helpers import live_gateway, wait_for
from tests.scripted_engine import ScriptedEngine
from tests.unit.test_datapool import make_step

CHAT = "/v1/chat/completions"
FULL = "database or disk is full"
NAME = "policy"


# ---- the writer survives failed commits ---------------------------------------------------------
class FlakyConnection(sqlite3.Connection):
    """A real SQLite connection whose COMMIT (or ROLLBACK) fails on demand, as SQLite's does on a
    full disk: the transaction is rolled back and OperationalError raised."""

    fail_commit = False
    fail_rollback = False

    def execute(self, sql, *args):  # type: ignore[override]
        if sql == "COMMIT" and self.fail_commit:
            super().execute("ROLLBACK")
            raise sqlite3.OperationalError(FULL)
        if sql == "ROLLBACK" and self.fail_rollback:
            self.fail_rollback = False
            raise sqlite3.OperationalError("disk I/O error")
        return super().execute(sql, *args)


def insert(conn, values):
    conn.executemany("INSERT INTO t VALUES (?)", [(v,) for v in values])
    return [True] * len(values)


def unknown(conn):
    raise KeyError("no such step")  # a write's own error: not the database's


@pytest.fixture
def flaky(tmp_path):
    conn = sqlite3.connect(tmp_path / "w.sqlite3", factory=FlakyConnection, isolation_level=None,
                           check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (x INTEGER)")
    writer = GroupCommitWriter(conn, 64, 1000, unavailable=lambda e: isinstance(e, sqlite3.OperationalError))
    yield conn, writer
    writer.close()


def test_a_failed_commit_fails_its_batch_only_and_the_writer_runs_on(flaky):
    conn, writer = flaky
    assert writer.submit(insert, 1).result() and writer.failure() is None
    conn.fail_commit = True
    futures = [writer.submit(insert, v) for v in (2, 3, 4)]
    for future in futures:
        with pytest.raises(sqlite3.OperationalError, match=FULL):
            future.result(timeout=5)
    assert writer.failure() == f"OperationalError: {FULL}"
    assert writer._thread.is_alive()
    conn.fail_commit = False
    # A commit that stored nothing (an idle sweep finding nothing) proves nothing: still failing.
    assert writer.run(lambda c: c.execute("DELETE FROM t WHERE x < 0").rowcount) == 0
    assert writer.failure() is not None
    # A write's own error (an unknown id) neither sets nor clears it.
    with pytest.raises(KeyError):
        writer.run(unknown)
    assert writer.failure() is not None
    assert writer.submit(insert, 5).result() is True  # stored something: the pool writes again
    assert writer.failure() is None
    with pytest.raises(KeyError):
        writer.run(unknown)
    assert writer.failure() is None
    assert [r[0] for r in conn.execute("SELECT x FROM t ORDER BY x")] == [1, 5]


def test_check_clears_the_failure_and_a_failed_rollback_does_not_end_the_writer(flaky):
    conn, writer = flaky
    conn.fail_commit = True
    with pytest.raises(sqlite3.OperationalError):
        writer.check(lambda c: c.execute("PRAGMA user_version=1"))
    assert writer.failure() is not None
    conn.fail_commit = False
    writer.check(lambda c: c.execute("PRAGMA user_version=1"))  # changes no row, and still proves it
    assert writer.failure() is None

    def breaks(c):
        c.execute("INSERT INTO t VALUES (9)")
        raise sqlite3.OperationalError("disk I/O error")

    conn.fail_rollback = True  # the ROLLBACK after the failed write fails too
    with pytest.raises(sqlite3.OperationalError) as caught:
        writer.submit(run_each, breaks).result(timeout=5)
    assert "ROLLBACK failed" in "".join(caught.value.__notes__)
    assert writer.failure() == "OperationalError: disk I/O error"
    assert writer.submit(insert, 7).result(timeout=5) is True  # the next batch ended the old transaction first
    assert writer.failure() is None
    assert [r[0] for r in conn.execute("SELECT x FROM t")] == [7]


def test_a_healthy_pool_says_it_can_write(open_test_pool):
    """The contract on both backends: a pool that writes has no write error, and its probe (a real
    commit of a tiny change) succeeds without changing what the pool holds."""
    pool = open_test_pool()
    assert pool.write_error() is None and pool.check_writable() is None
    assert pool.append_step(make_step("a")) is True
    assert pool.check_writable() is None and pool.write_error() is None
    assert pool.stats()["steps"] == 1


# ---- a real full disk ---------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs of our own, unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True,
                             text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or mounted.returncode})")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def fill(path: Path) -> None:
    """Write `path` until its file system has not one byte left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (1 << 20, 1 << 16, 4096, 512, 1):
            chunk = b"\xff" * size
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    assert shutil.disk_usage(path.parent).free == 0


def integrity(data_dir: Path) -> str:
    conn = sqlite3.connect(data_dir / POOL_FILE)
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()


def test_the_pool_on_a_full_disk_fails_writes_keeps_what_it_had_and_writes_again(small_disk):
    pool = SQLitePool(small_disk / "data", PoolConfig(commit_linger_ms=0))
    try:
        stored = [make_step(f"before-{i}", session=f"s{i}") for i in range(5)]
        assert pool.append_steps(stored) == [True] * 5
        fill(small_disk / "filler")
        with pytest.raises(sqlite3.OperationalError, match="full"):
            pool.append_step(make_step("lost", session="x"))
        assert "full" in pool.write_error()
        assert "bytes free" in pool.check_writable()  # no room: not even tried
        assert pool.write_error() is not None
        assert integrity(small_disk / "data") == "ok"  # reading needs no room
        assert [s.step_id for s in pool.get_steps([s.step_id for s in stored])] == [s.step_id for s in stored]

        (small_disk / "filler").unlink()
        assert pool.check_writable() is None
        assert pool.write_error() is None
        assert pool.append_step(make_step("after", session="y")) is True
        assert pool.stats()["steps"] == 6
        with pytest.raises(UnknownStepError):
            pool.get_steps(["lost"])
    finally:
        pool.close()
    assert integrity(small_disk / "data") == "ok"


def stored(pool, step_ids: list[str]) -> bool:
    """Every one of these steps is in the pool."""
    try:
        return len(pool.get_steps(step_ids)) == len(step_ids)
    except UnknownStepError:
        return False


def chat(client: httpx.Client, i: int) -> httpx.Response:
    return client.post(CHAT, json={"model": "m", "max_tokens": 8,
                                   "messages": [{"role": "user", "content": f"request {i}: say hello"}]})


@pytest.mark.parametrize("durable", [True, False])
def test_a_full_disk_under_a_live_gateway_refuses_then_recovers_by_itself(engine, small_disk, durable, monkeypatch):
    monkeypatch.setattr(Admission, "recheck_s", 0.5)  # the probe's period, shortened as a clock would be
    scripted = ScriptedEngine(engine, "Hello there.")
    data = small_disk / "data"
    with live_gateway(scripted, data, f"gateway.durable_reply={str(durable).lower()}") as (base, pool), \
            httpx.Client(base_url=base, timeout=30) as client:
        count = iter(range(10_000))
        before = []
        for _ in range(5):
            reply = chat(client, next(count))
            assert reply.status_code == 200, reply.text
            before.append(reply.json()["id"] + "-0")
        wait_for(lambda: pool.stats()["steps"] == 5, what="the first steps committed")

        fill(small_disk / "filler")
        answered, refused = [], []  # 200 replies (step ids) and 503 bodies, in order, while full
        lost_window = None  # how many 200s were answered before the first refusal
        for _ in range(40):
            # The pool object is the gateway's: once it reports the failure, admission must refuse.
            # How many replies go out before that depends on how far behind the writer thread is.
            reported = pool.write_error() is not None
            reply = chat(client, next(count))
            if reply.status_code == 200:
                assert not refused, f"answered 200 after refusing: {reply.text}"  # its step could not be stored
                assert not reported, "answered 200 after the pool reported that it cannot write"
                answered.append(reply.json()["id"] + "-0")
                continue
            assert reply.status_code == 503, reply.text
            refused.append(reply.json())
            lost_window = len(answered) if lost_window is None else lost_window
            if len(refused) == 5:
                break
        assert len(refused) == 5, f"the gateway kept answering 200 on a full disk ({len(answered)} times)"
        for body in refused:
            assert set(body["error"]) == {"message", "type", "param", "code"}
            assert body["error"]["code"] == "pool_unavailable" and body["error"]["type"] == "server_error"
            assert FULL not in body["error"]["message"]  # the database's own words are the log's (issue 41)
        if durable:
            assert answered == [], "with durable_reply, a reply is never answered before its commit"
        time.sleep(2 * Admission.recheck_s)  # probes run meanwhile, and fail: still refusing
        assert chat(client, next(count)).status_code == 503
        assert integrity(data) == "ok"
        assert stored(pool, before)

        (small_disk / "filler").unlink()
        freed = time.monotonic()
        while (reply := chat(client, next(count))).status_code != 200:
            assert reply.status_code == 503, reply.text
            assert time.monotonic() - freed < 3 * Admission.recheck_s + 2, "did not recover once space returned"
            time.sleep(0.1)
        recovered_s = time.monotonic() - freed
        after = [reply.json()["id"] + "-0"]
        for _ in range(4):
            reply = chat(client, next(count))
            assert reply.status_code == 200, reply.text
            after.append(reply.json()["id"] + "-0")
        wait_for(lambda: stored(pool, after), what="the replies after recovery recorded")
        assert stored(pool, before)
        assert pool.write_error() is None
        print(f"durable_reply={durable}: {lost_window or 0} replies answered before the first 503, "
              f"recovered {recovered_s:.1f} s after the space returned")
    assert integrity(data) == "ok"


# ---- the trainer killed mid-publish -------------------------------------------------------------
PUBLISHER = Path(__file__).parents[1] / "killable_publisher.py"


class Publisher:
    """`tests/killable_publisher.py` in a subprocess: it forks one publisher per command."""

    def __init__(self, root: Path, model_dir: Path, log: Path):
        self._log = open(log, "wb")  # noqa: SIM115 - the subprocess writes it until `close`
        self.proc = subprocess.Popen([sys.executable, str(PUBLISHER), str(root), str(model_dir)], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert self._line() == "ready"

    def _line(self) -> str:
        line = self.proc.stdout.readline().strip()
        assert line, f"the publisher process died (exit {self.proc.poll()}); see its log"
        return line

    def run(self, command: str, kill_after: float | None = None) -> int:
        """Run one forked publisher; with `kill_after`, SIGKILL it then. Returns its exit code."""
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        pid = int(self._line().removeprefix("pid "))
        if kill_after is not None:
            time.sleep(kill_after)
            os.kill(pid, signal.SIGKILL)
        _, child, code = self._line().split()
        assert int(child) == pid
        return int(code)

    def close(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self._log.close()


def check_store(root: Path, engine: LocalEngine) -> tuple[list[int], list[int]]:
    """Every version directory is complete (marker, readable config and tensors) or unmarked and
    refused by the engine; `newest` and `latest` name complete ones, and the engine loads `newest`.
    Returns (complete versions, unmarked versions)."""
    folder = root / NAME
    complete, unmarked = [], []
    for child in sorted(folder.iterdir()) if folder.is_dir() else []:
        match = re.fullmatch(r"v(\d+)", child.name)
        if match is None:
            continue  # LATEST, CONTROL and their temporary files
        version = int(match.group(1))
        if (child / adapters.MARKER).exists():
            assert adapters.read_marker(child) == {"name": NAME, "version": version, "rollback": None}
            assert json.loads((child / "adapter_config.json").read_text())["r"] == 4
            tensors = load_file(child / "adapter_model.safetensors")
            assert len(tensors) == 8 and all(t.isfinite().all() for t in tensors.values())  # 2 layers x q, v x A, B
            complete.append(version)
        else:
            unmarked.append(version)
            with pytest.raises(AdapterError):
                run(engine.load_adapter(NAME, child))
    newest, latest = adapters.newest(root, NAME), adapters.latest(root, NAME)
    if not complete:
        assert newest is None and latest is None
        return complete, unmarked
    assert latest[0] == max(complete) and newest[0] in complete and newest[0] <= latest[0]
    assert run(engine.load_adapter(NAME, newest[1])) == newest[0]
    assert engine.adapters()[NAME] == newest[0]
    return complete, unmarked


@pytest.fixture
def fresh_engine(tiny_model_dir):
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, max_batch=2))
    yield engine
    run(engine.close())


def test_a_publisher_killed_at_any_moment_never_leaves_a_version_that_is_served_half_written(
        tiny_model_dir, tmp_path, fresh_engine):
    root = tmp_path / "adapters"
    publisher = Publisher(root, tiny_model_dir, tmp_path / "publisher.log")
    rng = random.Random(14)
    seen_unmarked = 0
    try:
        # Killed right after each file it opens for writing (created or truncated, nothing written
        # yet), one file further each time: every boundary a crash can fall on, deterministically.
        cut = 1
        while publisher.run(f"cut {cut}") == -signal.SIGKILL:
            seen_unmarked += bool(check_store(root, fresh_engine)[1])
            cut += 1
        assert cut > 3, "a publish opens at least its config, its marker and its pointer"
        check_store(root, fresh_engine)
        # Killed at random moments while publishing back to back (a few ms each, fsyncs included):
        # 24 kills at least, and on until more than 24 versions were published between them (a
        # loaded machine publishes fewer before each kill).
        versions: set[int] = set()
        kills = 0
        while kills < 24 or (len(versions) <= 24 and kills < 200):
            kills += 1
            assert publisher.run("loop", kill_after=rng.uniform(0.0, 0.25)) == -signal.SIGKILL
            complete, unmarked = check_store(root, fresh_engine)
            versions.update(complete)
            seen_unmarked += bool(unmarked)
    finally:
        publisher.close()
    assert len(versions) > 24  # the loop kept publishing between kills
    print(f"{cut - 1} cut points, {kills} random kills, {max(versions)} versions published, "
          f"{seen_unmarked} checks found a half-written (unmarked) directory")
