"""What a client never gets (issue 41, low): an engine's or the database's own error text (paths,
tracebacks' last lines) goes to the log with a reference, the client the kind of failure and that
reference; and `/rl/start_session` costs one write a session, not one per session the task has.
Each test fails without its fix."""

from __future__ import annotations

import concurrent.futures
import logging

import httpx

from clawr1.core.types import EngineFailure
from tests.gateway_helpers import live_gateway
from tests.scripted_engine import ScriptedEngine

SECRET = "/srv/clawr1/secret-model/weights.safetensors"
HELLO = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}


class Failing(ScriptedEngine):
    """Fails every generation with a message naming a host path, at once or after two tokens."""

    def __init__(self, engine, at_once: bool):
        super().__init__(engine, "one two three four five six")
        self.at_once = at_once

    def generate(self, prompt_ids, sampling, adapter=None, affinity=None):
        if self.at_once:
            raise EngineFailure(f"engine step failed: RuntimeError: CUDA error loading {SECRET}")
        stream = super().generate(prompt_ids, sampling, adapter, affinity)
        step = stream.__anext__

        async def failing():
            if stream.sampled == 2:
                raise EngineFailure(f"the inference server failed: ReadError: {SECRET}")
            return await step()

        stream.__anext__ = failing
        return stream


def test_an_engines_error_text_goes_to_the_log_not_to_the_client(engine, tmp_path, caplog):
    caplog.set_level(logging.ERROR)
    with live_gateway(Failing(engine, at_once=True), tmp_path) as (base, _):
        plain = httpx.post(f"{base}/v1/chat/completions", json=HELLO, timeout=60)
        assert plain.status_code == 502 and plain.json()["error"]["code"] == "engine_failure"
        assert SECRET not in plain.text and "error " in plain.json()["error"]["message"]
        anthropic = httpx.post(f"{base}/v1/messages", json=HELLO, timeout=60)
        assert anthropic.status_code == 502 and SECRET not in anthropic.text
    with live_gateway(Failing(engine, at_once=False), tmp_path / "stream") as (base, _):
        streamed = httpx.post(f"{base}/v1/chat/completions", json={**HELLO, "stream": True}, timeout=60)
        assert streamed.status_code == 200 and '"engine_failure"' in streamed.text and SECRET not in streamed.text
    reference = plain.json()["error"]["message"].rsplit("error ", 1)[1].rstrip(")")
    assert any(reference in r.getMessage() and SECRET in r.getMessage() for r in caplog.records)


class Broken:
    """The pool, with a disk that fails every write (its message names the file)."""

    def __init__(self, pool, broken: bool = False):
        self.pool, self.broken = pool, broken

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def submit_step(self, step):
        failed: concurrent.futures.Future = concurrent.futures.Future()
        failed.set_exception(OSError(f"disk I/O error writing {SECRET}"))
        return failed

    def write_error(self):
        return f"database or disk is full: {SECRET}" if self.broken else None


def test_the_databases_error_text_goes_to_the_log_not_to_the_client(engine, tmp_path):
    with live_gateway(ScriptedEngine(engine, "Sure."), tmp_path, wrap_pool=Broken) as (base, _):
        failed = httpx.post(f"{base}/v1/chat/completions", json=HELLO, timeout=60)
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "pool_unavailable"
        assert SECRET not in failed.text and "OSError" not in failed.text
    with live_gateway(ScriptedEngine(engine, "Sure."), tmp_path / "full", wrap_pool=lambda p: Broken(p, True)) as (
            base, _):
        refused = httpx.post(f"{base}/v1/chat/completions", json=HELLO, timeout=60)
        assert refused.status_code == 503 and SECRET not in refused.text


class Writes:
    """The pool, counting `open_session` (a write each) and `show` (a read each)."""

    def __init__(self, pool):
        self.pool, self.opens, self.shows = pool, 0, 0

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def open_session(self, *args, **kwargs):
        self.opens += 1
        return self.pool.open_session(*args, **kwargs)

    def show(self, *args, **kwargs):
        self.shows += 1
        return self.pool.show(*args, **kwargs)


def test_starting_an_areal_session_costs_one_write_however_many_the_task_has(engine, tmp_path):
    """The n-th session of a task cost n writes (every number from 0 was tried in turn)."""
    admin = "admin-key-0123456789abcdef"
    counted: list[Writes] = []

    def start(base: str) -> str:
        answer = httpx.post(f"{base}/rl/start_session", json={"task_id": "t1"},
                            headers={"Authorization": f"Bearer {admin}"}, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()["session_id"]

    wrap = lambda pool: counted.append(Writes(pool)) or counted[-1]  # noqa: E731
    with live_gateway(engine, tmp_path, f'gateway.admin_key="{admin}"', wrap_pool=wrap) as (base, _):
        assert [start(base) for _ in range(60)] == [f"t1-{n}" for n in range(60)]
        assert counted[-1].opens == 60 and counted[-1].shows <= 1
    with live_gateway(engine, tmp_path, f'gateway.admin_key="{admin}"', wrap_pool=wrap) as (base, _):
        restored = counted[-1].shows  # the start-up's own reads (`restore_sessions`)
        assert start(base) == "t1-60"  # after a restart: found with a few reads
        assert counted[-1].opens == 1 and counted[-1].shows - restored <= 16
