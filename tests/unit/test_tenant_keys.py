"""Keys are checked before anything costs (issue 41): the front refuses a wrong key before it reads a
byte of the body and remembers per-session keys a worker said are unknown; a worker looks an
unknown key up once, never on its event loop, and keeps bounded caches; failed checks are rate
limited per address (agent keys, session keys, the admin key, the dashboard's sign-in); an agent's
session key serves its session and cannot rate it; a tenant named with no keys leaves the front's
browser checks on. Each test fails without its fix."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import httpx

from clawr1.core.config import load_config
from clawr1.datapool import open_pool
from clawr1.entrypoints.front import Front, serve
from clawr1.entrypoints.server import in_thread, make_server
from clawr1.entrypoints.workers import Workers
from clawr1.gateway import service, throttle
from clawr1.gateway.app import create_app
from clawr1.gateway.dispatch import key_digest
from clawr1.gateway.throttle import Throttle
from tests.gateway_helpers import steps_of, wait_for
from tests.scripted_engine import ScriptedEngine

AGENT, ADMIN = "sk-agent-0001", "admin-key-0123456789abcdef"
HELLO = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---- the front --------------------------------------------------------------------------------

def worker_app(seen: list[str]):
    """A worker that answers everything 200, but a per-session key starting `sk-clawr1-s-bad` 401 as
    the gateway does an unknown one; `seen` gets each request's path, and "stream ended" once the
    endless stream of `/stream` stops."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def endless():
        try:
            while True:
                yield b"data: " + b"x" * 8192 + b"\n\n"
                await asyncio.sleep(0)
        finally:
            seen.append("stream ended")

    async def stream(request):
        return StreamingResponse(endless(), media_type="text/event-stream")

    async def answer(request):
        seen.append(request.url.path)
        await request.body()
        if request.headers.get("authorization", "").startswith("Bearer sk-clawr1-s-bad"):
            return JSONResponse({"error": {"message": "unknown session key", "type": "authentication_error",
                                           "param": None, "code": "invalid_api_key"}}, status_code=401)
        return JSONResponse({"ok": True})

    async def healthz(request):
        return JSONResponse({"ok": True})

    return Starlette(routes=[Route("/healthz", healthz), Route("/stream", stream, methods=["POST"]),
                             Route("/{rest:path}", answer, methods=["GET", "POST"])])


@contextlib.contextmanager
def front_with_keys(tmp_path, limit: int = 30, send_timeout_s: float = 30.0):
    """A `Front` with the agent and admin keys' digests, over one counting worker."""
    seen: list[str] = []
    path = tmp_path / "w0.sock"
    worker = make_server(worker_app(seen), uds=str(path))
    listener = socket.create_server(("127.0.0.1", 0))
    stop, loop, ready = None, None, threading.Event()

    def main() -> None:
        nonlocal stop, loop

        async def go() -> None:
            nonlocal stop, loop
            stop, loop = asyncio.Event(), asyncio.get_running_loop()
            keys = frozenset(key_digest("k", key) for key in (AGENT, ADMIN))
            front = Front([path], 1024 * 1024, 64, "k", keys=keys, auth_failures_per_minute=limit,
                          send_timeout_s=send_timeout_s)
            await serve(front, listener, tmp_path / "ready", None, 30, stop)

        asyncio.run(go())

    with in_thread(worker, worker.serve, name="worker", start_timeout_s=30):
        thread = threading.Thread(target=main, daemon=True)
        thread.start()
        for _ in range(600):
            if (tmp_path / "ready").exists():
                break
            ready.wait(0.05)
        try:
            yield f"http://127.0.0.1:{listener.getsockname()[1]}", listener.getsockname()[1], seen
        finally:
            loop.call_soon_threadsafe(stop.set)
            thread.join(30)


def test_the_front_refuses_a_wrong_key_before_it_reads_the_body(tmp_path):
    with front_with_keys(tmp_path) as (base, port, seen):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:  # 1 MB announced, none sent
            raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-guess\r\n"
                        b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n")
            head = raw.recv(4096)  # waited for the body before the fix: this timed out
        assert head.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in head
        assert httpx.post(f"{base}/v1/messages", json={}, headers={"x-api-key": "nope"}).json()["type"] == "error"
        assert seen == []
        assert httpx.post(f"{base}/v1/chat/completions", json={}, headers=auth(AGENT)).status_code == 200
        assert httpx.post(f"{base}/admin/sessions", json={}, headers=auth(ADMIN)).status_code == 200
        assert httpx.get(f"{base}/healthz").status_code == 200 and httpx.get(f"{base}/dashboard").status_code == 200
        assert len(seen) == 3  # the dashboard signs in by itself
        # A per-session key goes to the worker that holds it; one it refused is refused here next time.
        for _ in range(3):
            assert httpx.post(f"{base}/v1/feedback", json={}, headers=auth("sk-clawr1-s-bad1")).status_code == 401
        assert seen.count("/v1/feedback") == 1
        assert httpx.post(f"{base}/v1/feedback", json={}, headers=auth("sk-clawr1-s-good")).status_code == 200


def test_the_front_rate_limits_failed_key_checks_per_address(tmp_path):
    with front_with_keys(tmp_path, limit=3) as (base, _, seen):
        assert [httpx.post(f"{base}/v1/chat/completions", json={}, headers=auth(f"sk-guess-{i}")).status_code
                for i in range(3)] == [401, 401, 401]
        blocked = httpx.post(f"{base}/v1/chat/completions", json={}, headers=auth(AGENT))
        assert blocked.status_code == 429 and blocked.json()["error"]["code"] == "too_many_failed_attempts"
        # Another address (a proxy on loopback names it) is not held back.
        other = httpx.post(f"{base}/v1/chat/completions", json={}, headers={
            **auth(AGENT), "X-Forwarded-For": "203.0.113.5", "X-Forwarded-Proto": "http"})
        assert other.status_code == 200 and seen == ["/v1/chat/completions"]


def test_the_front_drops_a_client_that_takes_no_data_and_hangs_up_on_the_worker(tmp_path):
    """A stream nobody reads held the front's handler, and the worker's stream behind it, for ever."""
    with front_with_keys(tmp_path, send_timeout_s=0.3) as (_, port, seen):
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        raw.connect(("127.0.0.1", port))
        raw.sendall(b"POST /stream HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + AGENT.encode()
                    + b"\r\nContent-Length: 0\r\n\r\n")
        try:
            wait_for(lambda: "stream ended" in seen, timeout=30, what="the worker's stream to end")
        finally:
            raw.close()


def test_a_throttle_forgets_a_window_once_it_is_over(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(throttle.time, "monotonic", lambda: now[0])
    guard = Throttle(2)
    guard.failed("a")
    guard.check("a")
    guard.failed("a")
    for who, refused in (("a", True), ("b", False)):
        try:
            guard.check(who)
        except Exception as exc:  # noqa: BLE001 - asserted below
            assert refused and exc.status == 429
        else:
            assert not refused
    now[0] += throttle.WINDOW_S
    guard.check("a")  # the minute is over
    assert "a" not in guard.blocked


def test_a_tenant_named_with_no_keys_leaves_the_fronts_browser_checks_on(tmp_path):
    """With `tenants.keys = {acme = []}` and several workers the front skipped its Host and
    cross-site checks; and the fronts get HMACs of the keys, never the keys."""
    def workers_of(*overrides: str) -> Workers:
        config = load_config(None, [f'data_dir="{tmp_path}"', "gateway.workers=2", "gateway.port=0", *overrides])
        return Workers(config)

    for overrides, open_gateway in ((['tenants.keys={acme = []}'], True),
                                    ([f'tenants.keys={{acme = ["{AGENT}"]}}', f'gateway.admin_key="{ADMIN}"'], False)):
        workers = workers_of(*overrides)
        try:
            assert ("--no-keys" in workers.front_argv(0)) == open_gateway
            digests = workers.env["CLAWR1_KEY_DIGESTS"]
            assert AGENT not in digests and ADMIN not in digests
            expected = [] if open_gateway else [key_digest(workers.key, AGENT), key_digest(workers.key, ADMIN)]
            assert digests == ",".join(expected)
        finally:
            workers.listener.close()
            workers.log.close()


# ---- a worker (one gateway process) -----------------------------------------------------------

class Lookups:
    """The pool, counting `session_by_key` and noting whether one ran on an event loop."""

    def __init__(self, pool):
        self.pool, self.calls, self.on_loop = pool, 0, 0

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def session_by_key(self, digest):
        self.calls += 1
        try:
            asyncio.get_running_loop()
            self.on_loop += 1
        except RuntimeError:
            pass
        return self.pool.session_by_key(digest)


@contextlib.contextmanager
def gateway(engine, tmp_path, *overrides: str, wrap=None):
    config = load_config(None, [f'data_dir="{tmp_path}"', f'gateway.api_keys=["{AGENT}"]',
                                f'gateway.admin_key="{ADMIN}"', *overrides])
    pool = open_pool(config)
    served = wrap(pool) if wrap else pool
    app = create_app(ScriptedEngine(engine, "Sure."), served, config)
    server = make_server(app)
    try:
        with in_thread(server, server.serve, name="gateway", start_timeout_s=20) as background:
            yield f"http://127.0.0.1:{background.port}", pool, app.state.gateway, served
    finally:
        pool.close()


def test_an_unknown_session_key_is_looked_up_once_and_never_on_the_event_loop(engine, tmp_path):
    with gateway(engine, tmp_path, wrap=Lookups) as (base, _, _, lookups):
        guess = auth("sk-clawr1-s-guess")
        paths = ("/v1/feedback", "/v1/feedback", "/v1/sessions/s1/close", "/v1/chat/completions", "/rl/end_session")
        for path in paths:
            assert httpx.post(base + path, json={"reward": 1, **HELLO}, headers=guess).status_code == 401
        assert httpx.get(f"{base}/v1/models", headers=auth("sk-clawr1-s-other")).status_code == 401
        assert (lookups.calls, lookups.on_loop) == (2, 0)


def test_the_session_key_caches_are_bounded(engine, tmp_path, monkeypatch):
    monkeypatch.setattr(service, "KEY_CACHE", 4, raising=False)
    with gateway(engine, tmp_path) as (base, _, gw, _):
        keys = [httpx.post(f"{base}/admin/sessions", json={}, headers=auth(ADMIN)).json()["api_key"] for _ in range(10)]
        for i in range(10):
            httpx.get(f"{base}/v1/models", headers=auth(f"sk-clawr1-s-guess{i}"))
        assert len(gw._session_keys) <= 4 and len(gw._unknown_keys) <= 4
        assert httpx.get(f"{base}/v1/models", headers=auth(keys[0])).status_code == 200  # read again from the pool


def test_failed_key_checks_are_rate_limited_per_address(engine, tmp_path):
    with gateway(engine, tmp_path, "gateway.auth_failures_per_minute=3") as (base, _, _, _):
        wrong = [auth("sk-wrong-key"), auth("sk-clawr1-s-guess"), auth("admin-guess-0123456789")]
        assert [httpx.post(f"{base}/admin/sessions" if i == 2 else f"{base}/v1/chat/completions", json=HELLO,
                           headers=h).status_code for i, h in enumerate(wrong)] == [401, 401, 401]
        held = httpx.post(f"{base}/v1/chat/completions", json=HELLO, headers=auth(AGENT))
        assert held.status_code == 429 and held.json()["error"]["code"] == "too_many_failed_attempts"
    with gateway(engine, tmp_path / "board", "gateway.auth_failures_per_minute=3") as (base, _, _, _):
        signs = [httpx.post(f"{base}/dashboard/login", data={"key": f"guess-{i}"}).status_code for i in range(3)]
        right = httpx.post(f"{base}/dashboard/login", data={"key": ADMIN})
        assert signs == [401, 401, 401] and right.status_code == 429


def test_an_agents_session_key_serves_its_session_and_cannot_rate_it(engine, tmp_path):
    """A black-box agent had the tenant's key: its model could post `/v1/feedback {"reward": 1}`."""
    with gateway(engine, tmp_path) as (base, pool, _, _):
        made = httpx.post(f"{base}/v1/sessions", json={"session_id": "rollout-1"}, headers=auth(AGENT))
        assert made.status_code == 200, made.text
        key = made.json()["api_key"]
        assert key.startswith("sk-clawr1-a-")
        turn = httpx.post(f"{base}/v1/chat/completions", json=HELLO, headers={**auth(key), "X-Session-Done": "true"})
        assert turn.status_code == 200
        [step] = steps_of(pool, 1)
        assert step.session_id == "rollout-1"
        refusals = [httpx.post(f"{base}/v1/feedback", json={"reward": 1}, headers=auth(key)),
                    httpx.post(f"{base}/v1/feedback", json={"completion_id": turn.json()["id"], "reward": 1},
                               headers=auth(key)),
                    httpx.post(f"{base}/v1/sessions/rollout-1/close", json={"outcome_reward": 1}, headers=auth(key)),
                    httpx.post(f"{base}/rl/set_reward", json={"reward": 1}, headers=auth(key)),
                    httpx.post(f"{base}/rl/end_session", headers=auth(key))]
        assert [r.status_code for r in refusals] == [403] * 5
        assert httpx.post(f"{base}/v1/sessions", json={}, headers=auth(key)).status_code == 403
        assert pool.show("rollout-1", "default", "session")["status"] == "open"  # X-Session-Done was not its call
        closed = httpx.post(f"{base}/v1/sessions/rollout-1/close", json={"outcome_reward": -1}, headers=auth(AGENT))
        assert closed.status_code == 200 and closed.json()["was_open"] is True
