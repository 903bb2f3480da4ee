"""No tenant can hurt another or the host (issue 41): a session named like a step id cannot break a
restart, close or AReaL's end_session; a request cannot store what its chat template never
rendered, nor more than one request may; a tenant past its storage quota is refused while the
others go on. Real gateway, real pool, the tiny model; each test fails without its fix."""

from __future__ import annotations

import json
import sqlite3

import httpx

from clawr1.datapool import POOL_FILE
from tests.gateway_helpers import live_gateway, steps_of, wait_for

ACME, GLOBEX = "sk-acme-0001", "sk-globex-0001"
TENANTS = f'tenants.keys={{acme = ["{ACME}"], globex = ["{GLOBEX}"]}}'
ASK = {"model": "m", "max_tokens": 2, "temperature": 0}


def chat(base: str, key: str, messages: list[dict], headers: dict | None = None, **extra) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=60, json={**ASK, "messages": messages, **extra},
                      headers={"Authorization": f"Bearer {key}", **(headers or {})})


def test_a_session_named_like_a_step_id_breaks_no_close_and_no_restart(engine, tmp_path):
    hello = [{"role": "user", "content": "hello"}]

    def session_named(base: str, key: str, name: str) -> None:
        created = httpx.post(f"{base}/sessions", json={"session_id": name}, headers={"Authorization": f"Bearer {key}"})
        assert created.status_code == 200, created.text
        turn = chat(base, key, [{"role": "user", "content": "more"}], {"X-Session-Id": name})
        assert turn.status_code == 200, turn.text

    with live_gateway(engine, tmp_path, TENANTS) as (base, pool):
        reply = chat(base, ACME, hello).json()
        step_ids = [reply["id"] + "-0", chat(base, ACME, [{"role": "user", "content": "hey"}]).json()["id"] + "-0"]
        for name in step_ids:  # another tenant names sessions after those steps ...
            session_named(base, GLOBEX, name)
        session_named(base, ACME, step_ids[0])  # ... and so does the steps' own, leaving it open
        steps_of(pool, 5)
        closed = httpx.post(f"{base}/v1/sessions/{step_ids[0]}/close", json={},
                            headers={"Authorization": f"Bearer {GLOBEX}"})
        assert closed.status_code == 200 and closed.json()["turns"] == 1, closed.text  # its turn, not the step
        ended = httpx.post(f"{base}/{step_ids[1]}/rl/end_session", headers={"Authorization": f"Bearer {GLOBEX}"})
        assert ended.status_code == 200 and ended.json()["interaction_count"] == 1, ended.text
    # The open sessions (the one named like a step among them) are restored at the next start.
    with live_gateway(engine, tmp_path, TENANTS) as (base, pool):
        followed = chat(base, ACME, hello + [reply["choices"][0]["message"], {"role": "user", "content": "again"}])
        assert followed.status_code == 200
        steps = steps_of(pool, 6)
        [first] = [s for s in steps if s.step_id == step_ids[0]]
        assert {s.session_id for s in steps if s.messages[-1]["content"] == "again"} == {first.session_id}


def test_start_up_skips_a_record_it_cannot_restore(engine, tmp_path):
    with live_gateway(engine, tmp_path, TENANTS) as (base, pool):
        bad = chat(base, ACME, [{"role": "user", "content": "a"}]).json()
        good_messages = [{"role": "user", "content": "b"}]
        good = chat(base, GLOBEX, good_messages).json()
        steps_of(pool, 2)
    with sqlite3.connect(tmp_path / POOL_FILE) as conn:  # a record no code of ours could parse
        conn.execute("UPDATE steps SET messages = 'not json' WHERE step_id = ?", (bad["id"] + "-0",))
    with live_gateway(engine, tmp_path, TENANTS) as (base, pool):
        more = good_messages + [good["choices"][0]["message"], {"role": "user", "content": "c"}]
        assert chat(base, GLOBEX, more).status_code == 200
        wait_for(lambda: pool.stats(tenant="globex")["steps"] == 2)
        assert len(pool.sessions(tenant="globex")) == 1  # restored: one conversation


def test_unknown_fields_are_not_stored_and_a_request_stores_within_its_bound(engine, tmp_path):
    junk = "x" * 1_000_000
    message = {"role": "user", "content": [{"type": "text", "text": "hi", "pad": junk}], "x": junk}
    history = [{"role": "assistant", "content": "ok", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}", "pad": junk}, "pad": junk}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done", "pad": junk}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}, "pad": junk}]
    with live_gateway(engine, tmp_path, TENANTS, "gateway.max_request_store_bytes=20000") as (base, pool):
        assert chat(base, ACME, [*history, message], n=8, max_tokens=1, tools=tools).status_code == 200
        steps = steps_of(pool, 8)
        assert all(junk not in json.dumps([s.messages, s.tools]) for s in steps)
        assert steps[0].messages[-1] == {"role": "user", "content": [{"type": "text", "text": "hi"}]}
        assert pool.stats(tenant="acme")["stored_bytes"] < 8 * 5_000
        # What the template renders counts: a long message, eight times, is past the bound.
        long = [{"role": "user", "content": "word " * 300}]
        refused = chat(base, ACME, long, n=8)
        assert refused.status_code == 413 and refused.json()["error"]["code"] == "request_too_large"
        assert chat(base, ACME, long, n=1).status_code == 200
        assert len(steps_of(pool, 9)) == 9  # nothing of the refused request


def test_a_tenant_past_its_storage_quota_is_refused_and_the_others_are_not(engine, tmp_path):
    quota = 'tenants.storage_quotas={acme = 1048576}'
    big = [{"role": "user", "content": "word " * 450}]  # ~2.3 KB of messages and ~450 token ids a step
    with live_gateway(engine, tmp_path, TENANTS, quota) as (base, pool):
        statuses = [chat(base, ACME, big, n=8, max_tokens=1).status_code for _ in range(40)]
        assert statuses.count(200) >= 10 and statuses[-1] == 429, statuses
        refused = chat(base, ACME, big)
        assert refused.json()["error"]["type"] == "insufficient_quota"
        assert refused.json()["error"]["code"] == "storage_quota_exceeded"
        assert chat(base, GLOBEX, big).status_code == 200  # another tenant does not notice
        used = wait_for(lambda: pool.stats(tenant="acme")["stored_bytes"] if pool.pending_writes() == 0 else 0)
        assert 1024**2 <= used < 1024**2 + 8 * 10_000  # over by at most the request that crossed it
    # The count survives a restart: the pool keeps it.
    with live_gateway(engine, tmp_path, TENANTS, quota) as (base, pool):
        assert chat(base, ACME, big).status_code == 429
        assert chat(base, GLOBEX, big).status_code == 200


def test_an_older_pool_counts_its_steps_when_opened(engine, tmp_path):
    with live_gateway(engine, tmp_path, TENANTS) as (base, pool):
        chat(base, ACME, [{"role": "user", "content": "count me"}])
        steps_of(pool, 1)
        counted = pool.tenant_usage()
    with sqlite3.connect(tmp_path / POOL_FILE) as conn:  # as a v3 file was: no usage table
        conn.execute("DROP TABLE tenant_usage")
        conn.execute("PRAGMA user_version=3")
    with live_gateway(engine, tmp_path, TENANTS) as (_, pool):
        assert pool.tenant_usage() == counted and counted["acme"] > 100
