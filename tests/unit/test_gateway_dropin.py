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
    from clawr1.gateway.server import check_exposure, serve

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
