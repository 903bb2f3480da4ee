"""Feedback, closing, per-session keys, idle timeout, disconnects and backpressure, over real HTTP."""

from __future__ import annotations

import asyncio
import sqlite3

import httpx
import openai
import pytest

from clawr1.datapool import POOL_FILE
from tests.conftest import run
from tests.gateway_helpers import live_gateway, steps_of, wait_for

ADMIN = "admin-key-0123456789abcdef"
ASK = {"model": "m", "max_tokens": 3, "temperature": 0}


def chat(base: str, content: str, headers: dict | None = None, **extra) -> httpx.Response:
    body = {**ASK, "messages": [{"role": "user", "content": content}], **extra}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers or {}, timeout=30)
    response.raise_for_status()
    return response


def sample_of(pool, step_id: str) -> dict:
    return pool.show(step_id)["sample"]


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


def test_feedback_rewards_and_hints_a_turn(engine, tmp_path):
    with live_gateway(engine, tmp_path) as (base, pool):
        first = chat(base, "hello", {"X-Session-Id": "fb"}).json()
        chat(base, "again", {"X-Session-Id": "fb"})
        steps_of(pool, 2)
        # The latest main turn by default; a correction becomes a hint.
        response = httpx.post(f"{base}/v1/feedback", json={"session_id": "fb", "reward": -1,
                                                           "correction": "Please answer in one word."})
        assert response.status_code == 200, response.text
        [latest] = response.json()["step_ids"]
        detail = pool.show(latest)
        assert detail["turn_index"] == 1 and detail["sample"]["reward"] == -1 and detail["sample"]["status"] == "ready"
        assert [r["source"] for r in detail["rewards"]] == ["feedback"]
        assert [h["text"] for h in detail["hints"]] == ["Please answer in one word."]
        # By completion id (what any OpenAI client sees), on the first turn.
        response = httpx.post(f"{base}/v1/feedback", json={"completion_id": first["id"], "reward": 1})
        assert response.json()["step_ids"] == [first["id"] + "-0"]
        assert sample_of(pool, first["id"] + "-0")["reward"] == 1
        # Errors: OpenAI-shaped, nothing recorded.
        assert_error(httpx.post(f"{base}/v1/feedback", json={"session_id": "nope", "reward": 1}), 404, "session_not_found")
        assert_error(httpx.post(f"{base}/v1/feedback", json={"session_id": "fb", "turn_index": 9, "reward": 1}), 404)
        assert_error(httpx.post(f"{base}/v1/feedback", json={"session_id": "fb"}), 400)
        assert assert_error(httpx.post(f"{base}/v1/feedback", json={"session_id": "fb", "reward": 2}), 400)["param"] == "reward"
        assert pool.stats()["rewards"] == 2 and pool.stats()["hints"] == 1


def test_close_with_outcome_and_session_done_header(engine, tmp_path):
    with live_gateway(engine, tmp_path) as (base, pool):
        chat(base, "one", {"X-Session-Id": "c"})
        chat(base, "two", {"X-Session-Id": "c"})
        steps_of(pool, 2)
        response = httpx.post(f"{base}/v1/sessions/c/close", json={"outcome_reward": 1})
        assert response.json()["was_open"] is True
        session = pool.show("c")
        assert session["status"] == "closed" and session["outcome_reward"] == 1
        last = session["steps"][-1]
        assert last["turn_index"] == 1 and last["reward"] == 1 and last["status"] == "ready"
        assert httpx.post(f"{base}/v1/sessions/c/close").json()["was_open"] is False  # twice is harmless
        assert_error(httpx.post(f"{base}/v1/sessions/zzz/close"), 404, "session_not_found")

        # X-Session-Done closes once the turn is stored; its last turn has no next state: masked.
        reply = chat(base, "bye", {"X-Session-Id": "d", "X-Session-Done": "true"}).json()
        steps_of(pool, 3)
        wait_for(lambda: pool.show("d")["status"] == "closed", what="session d closed")
        assert sample_of(pool, reply["id"] + "-0")["reason"] == "masked"


def test_a_closed_stock_conversation_is_not_continued(engine, tmp_path):
    with live_gateway(engine, tmp_path) as (base, pool):
        history = [{"role": "user", "content": "stock client"}]
        reply = httpx.post(f"{base}/v1/chat/completions", json={**ASK, "messages": history}).json()
        [step] = steps_of(pool, 1)
        httpx.post(f"{base}/v1/sessions/{step.session_id}/close").raise_for_status()
        history += [reply["choices"][0]["message"], {"role": "user", "content": "more"}]
        httpx.post(f"{base}/v1/chat/completions", json={**ASK, "messages": history}).raise_for_status()
        steps = steps_of(pool, 2)
        assert len({s.session_id for s in steps}) == 2  # the matcher forgot the closed session


def test_per_session_keys(engine, tmp_path):
    overrides = (f'gateway.admin_key="{ADMIN}"', 'gateway.api_keys=["sk-agent"]')
    with live_gateway(engine, tmp_path, *overrides) as (base, pool):
        new = f"{base}/admin/sessions"
        assert_error(httpx.post(new, json={}), 401)
        assert_error(httpx.post(new, json={}, headers={"Authorization": "Bearer sk-agent"}), 401)
        created = httpx.post(new, json={"session_id": "keyed"}, headers={"Authorization": f"Bearer {ADMIN}"}).json()
        key = created["api_key"]
        assert created["id"] == "keyed" and key.startswith("sk-clawr1-s-")
        assert_error(httpx.post(new, json={"session_id": "keyed"}, headers={"Authorization": f"Bearer {ADMIN}"}), 409)
        # A stock client with nothing but the key: both turns land in its session, in order.
        client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
        for text in ("first", "second"):
            client.chat.completions.create(messages=[{"role": "user", "content": text}], **ASK)
        steps = steps_of(pool, 2)
        assert sorted((s.session_id, s.turn_index) for s in steps) == [("keyed", 0), ("keyed", 1)]
        bogus = openai.OpenAI(base_url=base + "/v1", api_key="sk-clawr1-s-bogus", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bogus.chat.completions.create(messages=[{"role": "user", "content": "x"}], **ASK)
        auth = {"Authorization": f"Bearer {key}"}
        assert httpx.post(f"{base}/v1/feedback", json={"reward": 1}, headers=auth).status_code == 200
        assert_error(httpx.post(f"{base}/v1/sessions/other/close", headers=auth), 403)
        listed = httpx.get(new, headers={"Authorization": f"Bearer {ADMIN}"}).json()["data"]
        assert [s["session_id"] for s in listed] == ["keyed"] and "key_hash" not in listed[0]
    raw = b"".join(p.read_bytes() for p in tmp_path.glob(POOL_FILE + "*"))
    assert key.encode() not in raw  # only its hash is stored

    # The key outlives a restart, and numbering resumes after the stored turns.
    with live_gateway(engine, tmp_path, *overrides) as (base, pool):
        client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
        client.chat.completions.create(messages=[{"role": "user", "content": "third"}], **ASK)
        steps = steps_of(pool, 3)
        assert sorted(s.turn_index for s in steps if s.session_id == "keyed") == [0, 1, 2]


def test_admin_routes_are_off_without_an_admin_key(engine, tmp_path):
    with live_gateway(engine, tmp_path) as (base, _):
        assert_error(httpx.post(f"{base}/admin/sessions", json={}), 403, "admin_disabled")


def test_idle_sessions_close_and_resume_numbering(engine, tmp_path):
    with live_gateway(engine, tmp_path, "gateway.session_idle_s=0.4") as (base, pool):
        chat(base, "hello", {"X-Session-Id": "idle"})
        wait_for(lambda: pool.stats()["steps"] == 1 and pool.show("idle")["status"] == "closed", what="idle close")
        closes = [e["data"] for e in pool.show("idle")["events"] if e["kind"] == "close"]
        assert closes == [{"reason": "idle", "outcome_reward": None}]
        chat(base, "back again", {"X-Session-Id": "idle"})
        steps = steps_of(pool, 2)
        assert sorted(s.turn_index for s in steps) == [0, 1]
        assert pool.show("idle")["steps"][-1]["turn_index"] == 1


def test_interleaved_requests_of_one_session_keep_turn_order(engine, tmp_path):
    with live_gateway(engine, tmp_path) as (base, pool):
        async def go():
            async with httpx.AsyncClient(timeout=30) as http:
                body = {**ASK, "messages": [{"role": "user", "content": "parallel"}]}
                await asyncio.gather(*[http.post(f"{base}/v1/chat/completions", json=body,
                                                 headers={"X-Session-Id": "par"}) for _ in range(6)])

        run(go())
        steps = steps_of(pool, 6)
        assert sorted(s.turn_index for s in steps) == list(range(6))
        links = [t["next_step_id"] for t in pool.show("par")["steps"]]
        assert links[:5] == [t["step_id"] for t in pool.show("par")["steps"]][1:]  # next states paired in order


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_and_stores_aborted(engine, tmp_path, stream):
    with live_gateway(engine, tmp_path) as (base, pool):
        body = {"model": "m", "messages": [{"role": "user", "content": "Long answer please."}], "max_tokens": 400,
                "temperature": 0, "stream": stream}
        if stream:  # read a few chunks, then hang up
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as response:
                lines = response.iter_lines()
                assert [next(lines) for _ in range(8)]
        else:  # the client gives up waiting for the whole reply (well before 400 tokens on an idle machine)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{base}/v1/chat/completions", json=body, timeout=0.15)
        [step] = steps_of(pool, 1)
        assert step.finish_reason == "aborted" and 0 < len(step.token_ids) < 400
        assert len(step.logprobs) == len(step.token_ids)


def test_429_when_the_pool_is_behind_and_nothing_accepted_is_lost(engine, tmp_path):
    # Replies that do not wait for their commit (with durable_reply they would wait for the lock).
    overrides = ("pool.writer_queue=3", "pool.busy_timeout_s=60", "gateway.durable_reply=false")
    with live_gateway(engine, tmp_path, *overrides) as (base, pool):
        blocker = sqlite3.connect(tmp_path / POOL_FILE, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # another process holds the write lock: the writer waits
        statuses = []
        for i in range(8):
            body = {**ASK, "messages": [{"role": "user", "content": f"q{i}"}]}
            response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
            statuses.append(response.status_code)
            if response.status_code == 429:
                assert_error(response, 429, "rate_limit_exceeded")
        blocker.execute("ROLLBACK")
        blocker.close()
        accepted = statuses.count(200)
        assert 429 in statuses and accepted >= 3 and set(statuses) == {200, 429}
        assert len(steps_of(pool, accepted)) == accepted  # every answered request was recorded


def test_a_stock_conversation_continues_across_a_restart(engine, tmp_path):
    history = [{"role": "user", "content": "remember me"}]
    with live_gateway(engine, tmp_path) as (base, pool):
        reply = httpx.post(f"{base}/v1/chat/completions", json={**ASK, "messages": history}).json()
        [first] = steps_of(pool, 1)
    history += [reply["choices"][0]["message"], {"role": "user", "content": "still there?"}]
    with live_gateway(engine, tmp_path) as (base, pool):
        httpx.post(f"{base}/v1/chat/completions", json={**ASK, "messages": history}).raise_for_status()
        steps = steps_of(pool, 2)
        assert {(s.session_id, s.turn_index) for s in steps} == {(first.session_id, 0), (first.session_id, 1)}
