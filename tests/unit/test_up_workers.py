"""`clawr1 up` with `gateway.workers = 2` on the tiny model: stock clients' conversations, compacted
ones included, each land in one session though two processes serve them; a version the trainer
publishes is served by both; Ctrl+C stops every process, and killing the leader stops the rest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from clawr1.gateway.dispatch import owner
from tests.gateway_helpers import free_port, healthy, interrupt, wait_for
from tests.unit.test_compaction import OPENCLAW_SUMMARY
from tests.unit.test_up import quick_up

SYSTEM = {"role": "system", "content": "You are a terse assistant."}


def chat(base: str, messages: list[dict], session: str | None = None) -> dict:
    headers = {"X-Session-Id": session} if session else {}
    response = httpx.post(f"{base}/v1/chat/completions", headers=headers, timeout=60,
                          json={"model": "m", "messages": messages, "max_tokens": 4})
    response.raise_for_status()
    return response.json()


def sessions_of(data_dir) -> dict[str, list[int]]:
    """session id -> its main turns' indices, from the pool (`clawr1 pool` reads the same file)."""
    import sqlite3

    with sqlite3.connect(data_dir / "pool.sqlite3") as conn:
        rows = conn.execute("SELECT session_id, turn_index FROM steps WHERE turn_type = 'main' ORDER BY turn_index")
        out: dict[str, list[int]] = {}
        for session, turn in rows:
            out.setdefault(session, []).append(turn)
    return out


def opening(worker: int, topic: str = "") -> str:
    """A first user message that the front routes to `worker` (no key is set: the key part is "")."""
    n = 0
    while owner("\n" + f"Opening {n}{topic}", 2) != worker:
        n += 1
    return f"Opening {n}{topic}"


def processes_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def gone(pid: int) -> bool:
    if not os.path.exists(f"/proc/{pid}"):
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] == "Z"


def test_up_with_two_gateway_workers(tiny_model_dir, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = quick_up(tiny_model_dir, tmp_path, port, "gateway.workers=2")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "CLAWR1_DATA_DIR": ""})
    try:
        wait_for(lambda: healthy(base), timeout=180, what="clawr1 up with two workers to serve")
        # Stock conversations, their openings chosen to land on both workers: one session each.
        sessions: dict[str, list[int]] = {}
        for c, worker in enumerate((0, 1, 0, 1)):
            history = [SYSTEM, {"role": "user", "content": opening(worker, f" (conversation {c})")}]
            for t in range(3):
                history = [*history, chat(base, history)["choices"][0]["message"], {"role": "user", "content": f"go on {t}"}]
            [(new, turns)] = [(s, turns) for s, turns in sessions_of(tmp_path).items() if s not in sessions]
            assert turns == [0, 1, 2]
            assert owner(new, 2) == worker  # named for the worker that holds it (closing it by id finds it)
            sessions[new] = turns
        # OpenClaw's compaction: the summary now opens the conversation, and routes elsewhere than
        # its first message did; the front asks the workers and the session continues.
        first = opening(1 - owner("\n" + OPENCLAW_SUMMARY, 2))  # (else it would pass without the asking)
        history = [SYSTEM, {"role": "user", "content": first}]
        reply = chat(base, history)["choices"][0]["message"]
        compacted = [SYSTEM, {"role": "user", "content": OPENCLAW_SUMMARY}, reply, {"role": "user", "content": "next"}]
        chat(base, compacted)
        [session] = [s for s, turns in sessions_of(tmp_path).items() if s not in sessions]
        assert sessions_of(tmp_path)[session] == [0, 1]
        # A version the trainer publishes reaches both workers (sessions named for each).
        named = {w: next(f"named-{n}" for n in range(100) if owner(f"named-{n}", 2) == w) for w in (0, 1)}
        for sid in named.values():
            chat(base, [{"role": "user", "content": "Write me a haiku."}], sid)
            chat(base, [{"role": "user", "content": "Write me a haiku."}, {"role": "assistant", "content": "ok"},
                        {"role": "user", "content": "No, that is wrong. Answer in one short sentence."}], sid)
            httpx.post(f"{base}/v1/feedback", json={"session_id": sid, "turn_index": 0, "reward": -1,
                                                    "correction": "Answer in one short sentence."}).raise_for_status()

        def served_everywhere() -> bool:
            return all(chat(base, [{"role": "user", "content": "probe"}], sid)["system_fingerprint"] != "clawr1-v0"
                       for sid in named.values())

        wait_for(served_everywhere, timeout=180, what="the new version served by both workers")
        children = processes_of(proc.pid)
        assert len(children) >= 3  # the trainer, the front, the follower
    finally:
        interrupt(proc)
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
    for child in children:
        wait_for(lambda c=child: gone(c), timeout=40, what=f"process {child} to exit")


def test_two_fronts_share_the_port_and_every_process_stops_when_the_leader_is_killed(tiny_model_dir, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "clawr1.cli.main", "serve", "--model", str(tiny_model_dir),
                             "--data-dir", str(tmp_path), "--port", str(port), "--set", "gateway.workers=2",
                             "--set", "gateway.fronts=2"], stderr=subprocess.DEVNULL,
                            env={**os.environ, "CLAWR1_DATA_DIR": ""})
    try:
        wait_for(lambda: healthy(base), timeout=120, what="clawr1 serve with two workers")
        wait_for(lambda: (tmp_path / "run" / "front-1.port").exists(), timeout=60, what="the second front")
        children = processes_of(proc.pid)
        assert len(children) == 3  # two fronts and a follower
        for n in range(8):  # a new connection each: the kernel spreads them over the fronts
            chat(base, [{"role": "user", "content": f"hello {n}"}])
        assert len(sessions_of(tmp_path)) == 8
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        for child in children:
            wait_for(lambda c=child: gone(c), timeout=30, what=f"process {child} to stop without its leader")
        time.sleep(0.2)
        assert not healthy(f"http://127.0.0.1:{port}")  # nothing left on the port
    finally:
        if proc.poll() is None:
            proc.kill()
