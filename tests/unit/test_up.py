"""`clawr1 up` end to end on the tiny model: a scripted client talks and corrects, the trainer
publishes, the gateway swaps, and no request fails meanwhile."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from tests.gateway_helpers import free_port, healthy, interrupt, wait_for


def ask(base: str, content: str, session: str | None = None, **extra) -> dict:
    headers = {"X-Session-Id": session} if session else {}
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 6, **extra}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)
    response.raise_for_status()
    return response.json()


def quick_up(model_dir, data_dir, port: int, *settings: str) -> list[str]:
    """`clawr1 up` on the tiny model that trains after two judged turns and serves the version at
    once (the loop and the swap; the guard's verdicts: test_guard.py); `settings` are more `--set`s."""
    return [sys.executable, "-m", "clawr1.cli.main", "up", "--model", str(model_dir), "--data-dir", str(data_dir),
            "--port", str(port), "--batch-size", "2", "--prm-m", "1", "--set", "trainer.max_wait_s=0",
            "--set", "gateway.adapter_poll_s=0.2", "--set", 'reward.judge="llm"', "--set", "trainer.lr=0.01",
            "--set", "guard.enabled=false", *(arg for setting in settings for arg in ("--set", setting))]


def test_up_learns_from_corrections_and_swaps_without_a_failed_request(tiny_model_dir, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = quick_up(tiny_model_dir, tmp_path, port)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "CLAWR1_DATA_DIR": ""})
    try:
        wait_for(lambda: healthy(base), timeout=120, what="clawr1 up to serve")
        probe = {"temperature": 0, "logprobs": True}
        before = ask(base, "Fixed probe prompt.", **probe)
        assert before["system_fingerprint"] == "clawr1-v0"

        served: list[tuple[int, str]] = []
        stop = threading.Event()

        def load() -> None:  # steady traffic across the swap
            while not stop.is_set():
                response = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
                    "model": "m", "messages": [{"role": "user", "content": "background"}], "max_tokens": 3})
                served.append((response.status_code, response.json().get("system_fingerprint", "")))

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        for i in range(2):  # a conversation with a correction as its next turn, and explicit feedback
            ask(base, "Write me a haiku.", session=f"c{i}")
            ask(base, "No, that is wrong. Please answer in one short sentence.", session=f"c{i}")
            httpx.post(f"{base}/v1/feedback", json={"session_id": f"c{i}", "turn_index": 0, "reward": -1,
                                                    "correction": "Answer in one short sentence."}).raise_for_status()
        wait_for(lambda: any(fp not in ("", "clawr1-v0") for _, fp in served), timeout=120, what="a new version served")
        time.sleep(0.5)
        stop.set()
        loader.join(timeout=60)
        after = ask(base, "Fixed probe prompt.", **probe)
        assert after["system_fingerprint"] != "clawr1-v0"
        assert _logprobs(after) != _logprobs(before)
        assert {status for status, _ in served} == {200}  # not one failed request across the swap
        assert {fp for _, fp in served} >= {"clawr1-v0"} and len({fp for _, fp in served}) >= 2
        stats = subprocess.run([sys.executable, "-m", "clawr1.cli.main", "pool", "stats", "--json", "--data-dir",
                                str(tmp_path)], capture_output=True, text=True, check=True).stdout
        assert '"versions": ' in stats and '"versions": 0' not in stats
    finally:
        interrupt(proc)
    assert proc.returncode == 0, proc.stderr.read()[-2000:]


def _logprobs(reply: dict) -> list[float]:
    return [c["logprob"] for c in reply["choices"][0]["logprobs"]["content"]]



def test_sigterm_stops_up_and_its_trainer(tiny_model_dir, tmp_path):
    """`kill <pid>` (what a service manager sends) must not orphan the trainer process."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "clawr1.cli.main", "up", "--model", str(tiny_model_dir),
                             "--data-dir", str(tmp_path), "--port", str(port)], stderr=subprocess.DEVNULL,
                            env={**os.environ, "CLAWR1_DATA_DIR": ""})
    try:
        wait_for(lambda: healthy(f"http://127.0.0.1:{port}"), timeout=120, what="clawr1 up to serve")
        children = wait_for(lambda: _children(proc.pid), timeout=30, what="the trainer process")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    for child in children:
        wait_for(lambda c=child: not os.path.exists(f"/proc/{c}") or _zombie(c), timeout=40, what=f"trainer {child} to exit")


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1].startswith("Z")


def test_up_trains_on_the_postgres_pool_and_keeps_its_dsn_private(tiny_model_dir, tmp_path, postgres):
    """The trainer child reads the DSN from a mode-0600 file (it got a redacted config before, and
    restarted forever without training); the DSN never reaches the terminal or the trainer log."""
    dsn = postgres.fresh()
    config = tmp_path / "clawr1.toml"
    config.write_text('[pool]\nbackend = "postgres"\npostgres_dsn = "' + dsn.replace("\\", "\\\\").replace('"', '\\"')
                      + '"\n')
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "clawr1.cli.main", "up", "--config", str(config), "--model", str(tiny_model_dir),
           "--data-dir", str(tmp_path / "data"), "--port", str(port), "--batch-size", "2", "--prm-m", "1",
           "--set", "trainer.max_wait_s=0", "--set", 'reward.judge="llm"', "--set", "guard.enabled=false"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "CLAWR1_DATA_DIR": ""})
    try:
        wait_for(lambda: healthy(base), timeout=120, what="clawr1 up to serve")
        [child_config] = (tmp_path / "data" / "run").glob("*.toml")
        assert child_config.stat().st_mode & 0o777 == 0o600
        for i in range(2):
            ask(base, "Write me a haiku.", session=f"c{i}")
            ask(base, "No, that is wrong. Please answer in one short sentence.", session=f"c{i}")
        log = tmp_path / "data" / "run" / "trainer.log"
        wait_for(lambda: (tmp_path / "data" / "adapters" / "policy" / "v000001" / "STABLE").is_file(), timeout=180,
                 what=f"the trainer on PostgreSQL to publish v1 (log: {log.read_text()[-1500:] if log.exists() else ''})")
        assert "restarting" not in log.read_text() and dsn not in log.read_text()
    finally:
        interrupt(proc)
    err = proc.stderr.read()
    assert proc.returncode == 0, err[-2000:]
    assert dsn not in err and "starting it again" not in err
    assert not list((tmp_path / "data" / "run").glob("*.toml"))  # removed when up stopped
