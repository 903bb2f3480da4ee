"""What keys guard and what an open gateway refuses, over real HTTP: agent keys are real keys, a
per-session key speaks for its own session only, feedback names whole completions, an open
gateway refuses web pages (cross-site changes, rebound host names), `/healthz` lists adapters only
to whom may know them all, and a config error never prints a key."""

from __future__ import annotations

import httpx
import pytest

from clawr1.core.config import load_config
from clawr1.engine import adapters as store
from tests.gateway_helpers import live_gateway, steps_of
from tests.scripted_engine import ScriptedEngine

ADMIN = "admin-key-0123456789abcdef"
AGENT = "agent-key-123456"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture
def scripted(engine):
    return ScriptedEngine(engine, "Hello there.")


def test_an_agent_key_must_be_a_real_key():
    """An empty key (an unset shell variable in `--set`) would match a request with no key."""
    for short in ("", "k", "1234567"):
        with pytest.raises(ValueError, match="at least 8"):
            load_config(None, [f'gateway.api_keys=["{short}"]'])
    assert load_config(None, [f'gateway.api_keys=["{AGENT}"]']).gateway.api_keys == [AGENT]


def test_a_config_error_never_prints_a_key(capsys):
    from clawr1.cli.main import main

    code = main(["config", "--set", 'tenants.keys={acme=["sk-acme-PRODUCTION-SECRET"], globex=["short"]}'])
    err = capsys.readouterr().err
    assert code == 2 and "at least 8" in err
    assert "PRODUCTION-SECRET" not in err and "short" not in err.replace("at least 8", "")


def test_a_session_key_speaks_for_its_own_session_only(scripted, tmp_path):
    with live_gateway(scripted, tmp_path, f'gateway.admin_key="{ADMIN}"', f'gateway.api_keys=["{AGENT}"]') as (
            base, pool), httpx.Client(base_url=base, timeout=30) as http:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        keys = {sid: http.post("/admin/sessions", json={"session_id": sid}, headers=admin).json()["api_key"]
                for sid in ("victim", "mine")}
        mine = {"Authorization": f"Bearer {keys['mine']}"}
        for how in ({"X-Session-Id": "victim"}, {"X-Session-Id": "victim", "X-Session-Done": "true"}):
            refused = http.post("/v1/chat/completions", json=CHAT, headers={**mine, **how})
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
        refused = http.post("/victim/p-1/v1/chat/completions", json=CHAT, headers=mine)  # path ids
        assert refused.status_code == 403
        assert http.post("/v1/chat/completions", json=CHAT, headers={**mine, "X-Session-Id": "mine"}).status_code == 200
        assert http.post("/v1/chat/completions", json=CHAT, headers=mine).status_code == 200
        steps_of(pool, 2)
        assert len(pool.show("mine")["steps"]) == 2
        assert pool.show("victim")["steps"] == [] and pool.show("victim")["status"] == "open"


def test_feedback_names_a_whole_completion_of_the_callers_own_session(scripted, tmp_path):
    with live_gateway(scripted, tmp_path, f'gateway.admin_key="{ADMIN}"', f'gateway.api_keys=["{AGENT}"]') as (
            base, pool), httpx.Client(base_url=base, timeout=30) as http:
        agent = {"Authorization": f"Bearer {AGENT}"}
        ids = [http.post("/v1/chat/completions", json=CHAT, headers={**agent, "X-Session-Id": sid}).json()["id"]
               for sid in ("s-one", "s-two")]
        steps_of(pool, 2)
        key = http.post("/admin/sessions", json={"session_id": "mine"},
                        headers={"Authorization": f"Bearer {ADMIN}"}).json()["api_key"]
        mine = {"Authorization": f"Bearer {key}"}
        for prefix in ("chatcmpl", "chatcmpl-", ids[0][:-3]):  # a prefix names no completion, not every one
            refused = http.post("/v1/feedback", json={"completion_id": prefix, "reward": -1}, headers=agent)
            assert refused.status_code == 404, (prefix, refused.text)
        refused = http.post("/v1/feedback", json={"completion_id": ids[0], "reward": -1, "correction": "injected"},
                            headers=mine)
        assert refused.status_code == 404  # another session's completion, as if it did not exist
        own = http.post("/v1/chat/completions", json=CHAT, headers=mine).json()["id"]
        steps_of(pool, 3)
        rated = http.post("/v1/feedback", json={"completion_id": own, "reward": 1}, headers=mine)
        assert rated.status_code == 200 and rated.json()["step_ids"] == [f"{own}-0"]
        assert http.post("/v1/feedback", json={"completion_id": ids[1], "reward": -1}, headers=agent).status_code == 200
        assert [r["source"] for r in pool.show(f"{ids[0]}-0")["rewards"]] == []


def test_an_open_gateway_refuses_web_pages(scripted, tmp_path):
    """No keys: a cross-site form or text/plain POST changes nothing, a rebound host name reads
    nothing; programs and the dashboard's own same-origin forms work as before."""
    with live_gateway(scripted, tmp_path) as (base, pool), httpx.Client(base_url=base, timeout=30) as http:
        host = base.split("//", 1)[1]
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
        steps_of(pool, 1)
        evil = {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"}
        for origin in (evil, {"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"}, {"Origin": "null"}):
            pin = http.post("/dashboard/versions", content=b"action=pin&version=0", headers={
                **origin, "Content-Type": "application/x-www-form-urlencoded"})
            assert pin.status_code == 403 and pin.json()["error"]["code"] == "cross_site_refused", (origin, pin.text)
        feedback = http.post("/v1/feedback", content=b'{"session_id": "x", "reward": -1}',
                             headers={**evil, "Content-Type": "text/plain"})
        assert feedback.status_code == 403
        chat = http.post("/v1/messages", json={**CHAT, "max_tokens": 3}, headers=evil)  # in the route's own shape
        assert chat.status_code == 403 and chat.json()["type"] == "error"
        assert store.control(tmp_path / "adapters", "policy")["pinned"] is None
        rebound = http.get("/dashboard", headers={"Host": f"evil.example:{host.rsplit(':', 1)[1]}"})
        assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "host_not_allowed"
        for name in ("localhost", "127.0.0.1", "[::1]", "app.localhost"):
            assert http.get("/healthz", headers={"Host": f"{name}:8000"}).status_code == 200, name
        same = http.post("/dashboard/versions", content=b"action=unpin&version=0",
                         headers={"Origin": f"http://{host}", "Content-Type": "application/x-www-form-urlencoded"})
        assert same.status_code != 403
        assert http.get("/dashboard", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 200  # a link: reads only


def test_with_keys_host_names_are_the_keys_business(scripted, tmp_path):
    with live_gateway(scripted, tmp_path, f'gateway.api_keys=["{AGENT}"]') as (base, _), \
            httpx.Client(base_url=base, timeout=30) as http:
        answer = http.post("/v1/chat/completions", json=CHAT, headers={"Host": "gateway.internal.example",
                                                                       "Authorization": f"Bearer {AGENT}"})
        assert answer.status_code == 200


def test_healthz_lists_adapters_only_to_whom_may_know_them_all(scripted, tmp_path):
    with live_gateway(scripted, tmp_path, f'gateway.admin_key="{ADMIN}"', f'gateway.api_keys=["{AGENT}"]') as (
            base, _), httpx.Client(base_url=base, timeout=30) as http:
        assert http.get("/healthz").json() == {"ok": True}
        assert http.get("/healthz", headers={"Authorization": f"Bearer {AGENT}"}).json() == {"ok": True}
        assert "adapters" in http.get("/healthz", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    with live_gateway(scripted, tmp_path / "open") as (base, _):
        assert "adapters" in httpx.get(f"{base}/healthz").json()  # no keys: loopback only, nothing to hide
