"""Drop-in for the seeds' own clients, over real HTTP: Claw-R1's documented base URL without /v1,
Agent Lightning's per-rollout base URL, OpenClaw-RL's session fields in the request body, and the
gateway served over TLS."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import threading

import httpx
import openai
import pytest

from clawr1.core.config import load_config
from clawr1.datapool import SQLitePool
from tests.gateway_helpers import free_port, live_gateway, steps_of, wait_for
from tests.unit.test_gateway_lifecycle import ASK, assert_error


def test_claw_r1_base_url_without_v1_names_the_session_and_prompt(engine, tmp_path):
    """Claw-R1's agents set base_url = http://gateway:8000/{traj_uid}/{prompt_uid}: the OpenAI client
    then posts to /{traj}/{prompt}/chat/completions (and /completions, /responses)."""
    with live_gateway(engine, tmp_path) as (base, pool):
        client = openai.OpenAI(base_url=f"{base}/traj-7/prompt-3", api_key="unused")
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        client.completions.create(model="m", prompt="Once upon", max_tokens=3)
        client.responses.create(model="m", input="hello", max_output_tokens=3)
        steps = steps_of(pool, 3)
        assert {(s.session_id, s.prompt_id) for s in steps} == {("traj-7", "prompt-3")}
        assert reply.id + "-0" in {s.step_id for s in steps}
        assert [s.turn_index for s in sorted(steps, key=lambda s: s.turn_index)] == [0, 1, 2]
        # A /v1 URL under a prefix is not a pair of ids: 404, nothing recorded.
        for path in ("/api/v1/chat/completions", "/x/v1/completions", "/v1/chat/completions/x"):
            response = httpx.post(base + path, json={**ASK, "messages": [{"role": "user", "content": "hi"}],
                                                     "prompt": "hi"})
            assert response.status_code in (404, 405), (path, response.text)
        assert pool.stats()["steps"] == 3


def test_agent_lightning_rollout_base_url_names_the_attempt_and_its_rollout(engine, tmp_path):
    """Agent Lightning hands agents `{endpoint}/rollout/{rollout_id}/attempt/{attempt_id}/v1` (its
    `ProxyLLM.get_base_url`; no /v1 when the endpoint had none): each attempt is a session, the
    rollout its prompt id, so two attempts of one rollout are alternatives to the same prompt."""
    with live_gateway(engine, tmp_path) as (base, pool):
        for attempt, suffix in (("at-1", "/v1"), ("at-2", "")):
            client = openai.OpenAI(base_url=f"{base}/rollout/ro-9/attempt/{attempt}{suffix}", api_key="unused")
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
            client.completions.create(model="m", prompt="Once upon", max_tokens=3)
            client.responses.create(model="m", input="hello", max_output_tokens=3)
        steps = steps_of(pool, 6)
        assert {(s.session_id, s.prompt_id) for s in steps} == {("ro-9:at-1", "ro-9"), ("ro-9:at-2", "ro-9")}
        bad = httpx.post(f"{base}/rollout/ro-9/attempt/{'x' * 300}/v1/chat/completions",
                         json={**ASK, "messages": [{"role": "user", "content": "hi"}]})
        assert_error(bad, 400)
        assert pool.stats()["steps"] == 6


def test_openclaw_rl_session_fields_in_the_body(engine, tmp_path):
    """OpenClaw-RL's clients send session_id, turn_type and session_done in the body too; a header
    that is also there wins; a field of the wrong type is a 400 that holds no admission slot."""
    def post(base: str, content: str, headers: dict | None = None, **fields) -> httpx.Response:
        body = {**ASK, "messages": [{"role": "user", "content": content}], **fields}
        return httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers or {}, timeout=30)

    with live_gateway(engine, tmp_path, "gateway.max_pending=1") as (base, pool):
        first = post(base, "one", session_id="body-s", turn_type="main").json()
        side = post(base, "probe", session_id="body-s", turn_type="side").json()
        header = post(base, "two", {"X-Session-Id": "header-s"}, session_id="body-s").json()
        steps = {s.step_id: s for s in steps_of(pool, 3)}
        assert steps[first["id"] + "-0"].session_id == "body-s" and steps[first["id"] + "-0"].turn_type == "main"
        assert steps[side["id"] + "-0"].session_id == "body-s" and steps[side["id"] + "-0"].turn_type == "side"
        assert steps[header["id"] + "-0"].session_id == "header-s"

        for bad in ({"session_id": ["x"]}, {"session_done": 3}, {"turn_type": 1},
                    {"session_id": "a/b"}):
            error = assert_error(post(base, "bad", **bad), 400)
            assert error["param"] in ("session_id", "session_done", "turn_type", "X-Session-Id")
        assert post(base, "still served", session_id="after").status_code == 200  # max_pending 1: no slot leaked

        last = post(base, "bye", session_id="body-s", session_done=True).json()
        wait_for(lambda: pool.show("body-s")["status"] == "closed", what="the body's session_done")
        assert pool.show(last["id"] + "-0")["sample"]["reason"] == "masked"  # no next state will come


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (openssl, as an operator would make one)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def test_the_gateway_serves_tls_to_the_openai_client(tiny_model_dir, tmp_path, certificate):
    from clawr1.core.config import EngineConfig
    from clawr1.engine.local import LocalEngine
    from clawr1.entrypoints.serve import serve
    from clawr1.gateway.server import check_exposure

    cert, key = certificate
    port = free_port()
    config = load_config(None, [f'data_dir="{tmp_path}"', f"gateway.port={port}", f'gateway.tls_cert="{cert}"',
                                f'gateway.tls_key="{key}"'])
    assert "HTTPS" in check_exposure(config.model_copy(update={"gateway": config.gateway.model_copy(
        update={"host": "0.0.0.0", "api_keys": ["k"]})}))
    ready, loop = threading.Event(), asyncio.new_event_loop()
    task: list[asyncio.Task] = []

    def run() -> None:
        async def go() -> None:
            task.append(asyncio.current_task())
            engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1))  # `serve` closes it
            await serve(config, on_ready=lambda port, note: ready.set(), engine=engine,
                        pool=SQLitePool(tmp_path, config.pool))
        try:
            loop.run_until_complete(go())
        except asyncio.CancelledError:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30), "the TLS gateway did not start"
    try:
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key="unused",
                               http_client=httpx.Client(verify=ssl.create_default_context(cafile=str(cert))))
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert reply.choices[0].message.content is not None
        with pytest.raises(httpx.HTTPError):  # plain HTTP to a TLS port gets no reply
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
        with pytest.raises(httpx.ConnectError):  # and a client that does not trust the certificate refuses it
            httpx.get(f"https://127.0.0.1:{port}/healthz", timeout=5)
    finally:
        loop.call_soon_threadsafe(task[0].cancel)
        thread.join(timeout=30)
    with SQLitePool(tmp_path, config.pool) as pool:
        wait_for(lambda: pool.stats()["steps"] == 1, what="the TLS request recorded")


def test_tls_settings_come_in_pairs_of_existing_files(tmp_path, certificate):
    cert, _ = certificate
    with pytest.raises(ValueError, match="go together"):
        load_config(None, [f'gateway.tls_cert="{cert}"'])
    from clawr1.gateway.server import UnsafeBindError, check_exposure

    missing = load_config(None, [f'gateway.tls_cert="{cert}"', f'gateway.tls_key="{tmp_path / "missing.pem"}"'])
    with pytest.raises(UnsafeBindError, match="does not exist"):  # where the gateway starts, not on load
        check_exposure(missing)


def test_areal_key_style_session_reward_and_end(engine, tmp_path):
    """AReaL's proxy rollout server protocol: `/rl/start_session` with the admin key, then the
    agent's OpenAI calls (base URL without /v1), `/rl/set_reward` and `/rl/end_session`, all with
    the session's key (the calls AReaL's client makes, with its payloads)."""
    with live_gateway(engine, tmp_path, 'gateway.admin_key="areal-admin-key-0123"') as (base, pool):
        admin = {"Authorization": "Bearer areal-admin-key-0123"}
        started = [httpx.post(f"{base}/rl/start_session", json={"task_id": "math-1"}, headers=admin).json()
                   for _ in range(2)]
        assert [s["session_id"] for s in started] == ["math-1-0", "math-1-1"]  # AReaL's numbering per task
        first, second = started
        client = openai.OpenAI(base_url=base, api_key=first["api_key"])  # what AReaL's agents get: no /v1
        one = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1?"}], max_tokens=3)
        two = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+2?"}], max_tokens=3)
        key = {"Authorization": f"Bearer {first['api_key']}"}
        assert httpx.post(f"{base}/rl/set_reward", json={"interaction_id": one.id, "reward": 1.0},
                          headers=key).json()["message"] == "success"
        assert httpx.post(f"{base}/rl/set_reward", json={"reward": -1.0}, headers=key).status_code == 200  # the last
        # Another session's key cannot reward this session's interaction; an unknown one is a 400.
        other = {"Authorization": f"Bearer {second['api_key']}"}
        assert_error(httpx.post(f"{base}/rl/set_reward", json={"interaction_id": one.id, "reward": 1}, headers=other),
                     400)
        assert_error(httpx.post(f"{base}/rl/set_reward", json={"interaction_id": "chatcmpl-nope", "reward": 1},
                                headers=key), 400)
        assert_error(httpx.post(f"{base}/rl/set_reward", json={"reward": 5}, headers=key), 400)  # rewards are in [-1, 1]
        ended = httpx.post(f"{base}/rl/end_session", headers=key)
        assert ended.json() == {"message": "success", "interaction_count": 2}
        ended = assert_error(httpx.post(f"{base}/rl/end_session", headers=key), 410)  # AReaL: already ended
        assert ended["type"] == "invalid_request_error"  # the client's mistake, not the server's
        steps = {s.step_id: s for s in steps_of(pool, 2)}
        assert {s.session_id for s in steps.values()} == {"math-1-0"}
        rewards = {sid: pool.show(sid)["rewards"] for sid in (one.id + "-0", two.id + "-0")}
        assert [r["score"] for r in rewards[one.id + "-0"] if r["source"] == "feedback"] == [1.0]
        assert [r["score"] for r in rewards[two.id + "-0"] if r["source"] == "feedback"] == [-1.0]
        # Starting needs the admin key (or an agent key): a session key cannot, nor can nobody when keys are set.
        assert_error(httpx.post(f"{base}/rl/start_session", json={"task_id": "t"}, headers=key), 403)


def test_areal_path_style_session_groups_a_tasks_sessions(engine, tmp_path):
    """AReaL's `OpenAIProxyClientSession`: the session's base URL is `{base}/{session_id}/`, its
    reward and end calls go under it; the sessions of one task are alternatives to one prompt."""
    with live_gateway(engine, tmp_path) as (base, pool):
        sessions = [httpx.post(f"{base}/rl/start_session", json={"task_id": "gsm-7"}).json()["session_id"]
                    for _ in range(2)]
        for session in sessions:
            client = openai.OpenAI(base_url=f"{base}/{session}/", api_key="unused")
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "3+4?"}], max_tokens=3)
            client.responses.create(model="m", input="5+6?", max_output_tokens=3)
            assert httpx.post(f"{base}/{session}/rl/set_reward", json={"interaction_id": None, "reward": 1.0}
                              ).status_code == 200
            assert httpx.post(f"{base}/{session}/rl/end_session", json={}).json()["interaction_count"] == 2
        steps = steps_of(pool, 4)
        assert {(s.session_id, s.prompt_id) for s in steps} == {("gsm-7-0", "gsm-7"), ("gsm-7-1", "gsm-7")}
        # The plain routes are untouched: /v1/chat/completions is no session called "v1".
        httpx.post(f"{base}/v1/chat/completions", json={**ASK, "messages": [{"role": "user", "content": "hi"}]})
        assert "v1" not in {s["session_id"] for s in pool.sessions()}


def test_rllm_session_url_names_the_session(engine, tmp_path):
    """rLLM's model gateway: the trainer creates a session (`POST /sessions`), the agent gets
    `{gateway}/sessions/{id}/v1` as its base URL; every call lands in that one session, in order."""
    with live_gateway(engine, tmp_path) as (base, pool):
        created = httpx.post(f"{base}/sessions", json={"session_id": "rl-42", "metadata": {"task": "t"}})
        assert created.json() == {"session_id": "rl-42"}
        assert_error(httpx.post(f"{base}/sessions", json={"session_id": "rl-42"}), 409)
        generated = httpx.post(f"{base}/sessions", json={}).json()["session_id"]
        client = openai.OpenAI(base_url=f"{base}/sessions/rl-42/v1", api_key="EMPTY")
        history = [{"role": "user", "content": "hi"}]
        reply = client.chat.completions.create(model="m", messages=history, max_tokens=3)
        history += [{"role": "assistant", "content": reply.choices[0].message.content},
                    {"role": "user", "content": "and then?"}]
        client.chat.completions.create(model="m", messages=history, max_tokens=3)
        client.completions.create(model="m", prompt="Once upon", max_tokens=3)
        openai.OpenAI(base_url=f"{base}/sessions/{generated}/v1", api_key="EMPTY").responses.create(
            model="m", input="hello", max_output_tokens=3)
        steps = sorted(steps_of(pool, 4), key=lambda s: (s.session_id, s.turn_index))
        mine = [s for s in steps if s.session_id == "rl-42"]
        assert [s.turn_index for s in mine] == [0, 1, 2] and len({s.prompt_id for s in mine}) == 3  # per turn
        assert {s.session_id for s in steps} == {"rl-42", generated}
        bad = httpx.post(f"{base}/sessions/{'x' * 300}/v1/chat/completions",
                         json={**ASK, "messages": [{"role": "user", "content": "hi"}]})
        assert_error(bad, 400)
        assert pool.stats()["steps"] == 4
