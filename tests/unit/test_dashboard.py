"""`/dashboard` on a live gateway (tiny model, real pool, the real trainer publishing a version that
the gateway swaps in): what it shows, and who may see it."""

from __future__ import annotations

import re

import httpx
import pytest

from clawr1.core.config import EngineConfig, load_config
from clawr1.datapool import SQLitePool
from clawr1.engine.local import LocalEngine
from clawr1.gateway.dashboard.charts import Series, line_chart
from clawr1.gateway.dashboard.routes import COOKIE
from clawr1.trainer.loop import Trainer
from tests.conftest import run
from tests.gateway_helpers import live_gateway, wait_for

ADMIN = "admin-key-0123456789"


def chat(base: str, messages: list[dict], **headers: str) -> dict:
    response = httpx.post(f"{base}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": "m", "messages": messages, "max_tokens": 6, "temperature": 1.0, "seed": 1})
    response.raise_for_status()
    return response.json()


def admin(base: str, path: str, **kw) -> httpx.Response:
    return httpx.get(f"{base}{path}", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30, **kw)


@pytest.fixture(scope="module")
def own_engine(tiny_model_dir):
    """Its own engine: the versions this module swaps in must not leak into the shared one."""
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, max_batch=8))
    yield engine
    run(engine.close())


@pytest.fixture(scope="module")
def trained(own_engine, tiny_model_dir, tmp_path_factory):
    """A gateway and the real trainer over three rounds: a conversation served by version v, explicit
    feedback on its first turn (a correction twice, then approval), the trainer publishing v+1 from
    it, the gateway swapping v+1 in. Probes are side turns, so they are never samples."""
    data_dir = tmp_path_factory.mktemp("dashboard")
    overrides = [f'gateway.admin_key="{ADMIN}"', "gateway.adapter_poll_s=0.05", f'engine.model="{tiny_model_dir}"',
                 "trainer.batch_size=1", "trainer.max_wait_s=0", "trainer.lr=0.01",
                 "guard.enabled=false"]  # every version served at once: the guard's panel is in test_guard.py
    first = [{"role": "user", "content": "Say hi <script>alert(1)</script>"}]
    with live_gateway(own_engine, data_dir, *overrides) as (base, pool):
        config = load_config(None, [f'data_dir="{data_dir}"', *overrides])
        with SQLitePool(data_dir, config.pool) as trainer_pool:  # a second connection, as the trainer process has
            trainer = Trainer(config, trainer_pool)
            for version, reward in enumerate((-1, -1, 1)):
                session = {"X-Session-Id": f"conv-{version}"}
                reply = chat(base, first, **session)["choices"][0]["message"]["content"]
                chat(base, first + [{"role": "assistant", "content": reply},
                                    {"role": "user", "content": "No, answer in one short sentence."}], **session)
                wait_for(lambda n=2 * (version + 1): pool.stats()["main_steps"] == n, what="two recorded turns")
                feedback = {"session_id": f"conv-{version}", "turn_index": 0, "reward": reward}
                if reward < 0:
                    feedback["correction"] = "Answer in one short sentence."
                httpx.post(f"{base}/v1/feedback", timeout=30, json=feedback).raise_for_status()
                metrics = trainer.run_once()
                assert metrics is not None and metrics["version"] == version + 1
                served = f"clawr1-v{version + 1}"
                wait_for(lambda fp=served: chat(base, first, **{"X-Turn-Type": "side"})["system_fingerprint"] == fp,
                         what=f"{served} served")
                if version == 0:  # its correction turn never gets feedback: lost to training before v2
                    trainer_pool.close_session("conv-0", None, reason="idle")
        # The dashboard reads the trainer's numbers from the pool, not from the trainer's files (the
        # trainer may run on another host): without its log the panels must stay the same.
        (data_dir / "trainer" / "metrics.jsonl").unlink()
        yield base, pool


def test_summary_joins_serving_judging_and_training_per_version(trained):
    base, pool = trained
    s = admin(base, "/dashboard/api/summary").json()
    assert s["served_version"] == 3
    rows = s["versions"]
    assert [r["version"] for r in rows] == [0, 1, 2, 3]
    assert [r["turns"] for r in rows] == [2, 2, 2, 0]  # side-turn probes are not samples
    assert [r["preference_score"] for r in rows[:3]] == [0.0, 0.0, 1.0]
    assert [r["reward_mean"] for r in rows[1:]] == [-1.0, -1.0, 1.0] and all(r["loss"] is not None for r in rows[1:])
    assert [r["lost"] for r in rows] == [None, {}, {"masked": 1}, {}]  # conv-0's last turn, closed without feedback
    # /metrics has the newest version's (v3's) silent-failure counts, from the trainer's row in the pool.
    exposition = admin(base, "/metrics").text
    for measure, n in (("samples", 1), ("no_signal", 0), ("kl_silent", 0), ("lost_masked", 0), ("lost_judge", 0)):
        assert f'clawr1_trained_version{{measure="{measure}"}} {n:.1f}' in exposition, measure
    for r in rows[1:]:  # the feedback arrived, v was published from it, then v answered
        assert r["trained_on"] == 1 and 0 < r["publish_s"] <= r["latency_s"] == r["latency_max_s"]
        assert r["first_served_at"] > r["published_at"]
    assert s["pool"]["consumed"] == 3 and s["pool"]["db_bytes"] > 0
    trained = [(d["version"], d["status"]) for d in pool.policy_versions("policy")]
    # The trainer's rows, each beside the gateway's verdict: with the guard off, promoted as published.
    assert sorted(trained) == [(v, status) for v in (1, 2, 3) for status in ("promoted", "trained")]
    assert [x["version"] for x in s["gateway"]["swaps"]] == [1, 2, 3]
    assert {r["session_id"] for r in s["sessions"]} >= {"conv-0", "conv-1", "conv-2"}
    assert sum(r["status"] == "consumed" for r in s["samples"]) == 3


def test_page_renders_every_panel_with_curves_and_escapes_conversations(trained):
    base, _ = trained
    page = admin(base, "/dashboard")
    assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
    html = page.text
    for panel in ("overview", "curves", "versions", "queue", "sessions", "memory"):
        assert f'data-panel="{panel}"' in html
    charts = re.findall(r'data-series="(\d+)" data-points="(\d+)"', html)
    assert len(charts) == 4 and all(int(points) >= 3 for _, points in charts)  # reward, preference, drift, latency
    assert "conv-1" in html and "<script>alert" not in html
    panels = admin(base, "/dashboard/panels").json()
    assert set(panels) == {"overview", "curves", "versions", "queue", "sessions", "memory"} and "v3" in panels["versions"]


def test_session_page_shows_votes_evidence_hints_and_next_state(trained):
    base, _ = trained
    page = admin(base, "/dashboard/sessions/conv-1", params={"tenant": "default"})
    assert page.status_code == 200
    html = page.text
    assert "feedback" in html and "Answer in one short sentence." in html  # the explicit reward and its hint
    assert "No, answer in one short sentence." in html  # turn 0's next state
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "<script>alert" not in html
    assert "consumed" in html
    assert admin(base, "/dashboard/sessions/nope").status_code == 404


def test_admin_key_is_required_and_agent_keys_never_open_it(engine, tmp_path):
    with live_gateway(engine, tmp_path, f'gateway.admin_key="{ADMIN}"', 'gateway.api_keys=["agent-key"]') as (base, _):
        anonymous = httpx.get(f"{base}/dashboard")
        assert anonymous.status_code == 401 and 'name="key"' in anonymous.text  # the sign-in form
        agent = httpx.get(f"{base}/dashboard/api/summary", headers={"Authorization": "Bearer agent-key"})
        assert agent.status_code == 401 and agent.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.post(f"{base}/dashboard/login", data={"key": "agent-key"})
        assert wrong.status_code == 401 and COOKIE not in wrong.cookies
        signed = httpx.post(f"{base}/dashboard/login", data={"key": ADMIN})
        assert signed.status_code == 303 and "httponly" in signed.headers["set-cookie"].lower()
        cookie = signed.cookies[COOKIE]
        assert ADMIN not in cookie
        assert httpx.get(f"{base}/dashboard", cookies={COOKIE: cookie}).status_code == 200
        assert httpx.get(f"{base}/dashboard/panels", cookies={COOKIE: cookie}).status_code == 200
        assert httpx.get(f"{base}/dashboard", cookies={COOKIE: cookie[:-1] + "0"}).status_code == 401
        assert httpx.get(f"{base}/dashboard/static/dashboard.js").status_code == 200  # assets hold no data
        assert httpx.get(f"{base}/dashboard/static/..%2fdata.py").status_code == 404


def test_the_dashboards_forms_refuse_other_pages_with_keys_too(engine, tmp_path):
    """The login cookie is `SameSite=Strict`: a same-site page (another port of this host) still
    sends it. Such a page's form post is refused; the dashboard's own posts work."""
    from clawr1.engine import adapters as store
    from clawr1.gateway.dashboard.routes import cookie_token

    with live_gateway(engine, tmp_path, f'gateway.admin_key="{ADMIN}"') as (base, _):
        cookie = {COOKIE: cookie_token(ADMIN)}
        rollback = {"action": "rollback", "version": "0"}
        for page in ({"Origin": "http://127.0.0.1:9999", "Sec-Fetch-Site": "same-site"},
                     {"Origin": "http://127.0.0.1:9999"}, {"Sec-Fetch-Site": "cross-site"}):
            refused = httpx.post(f"{base}/dashboard/versions", cookies=cookie, data=rollback, headers=page)
            assert refused.status_code == 403 and "may not change anything" in refused.text
            assert httpx.post(f"{base}/dashboard/logout", cookies=cookie, headers=page).status_code == 403
        assert store.control(tmp_path / "adapters", "policy").get("rollback") is None
        own = {"Origin": base, "Sec-Fetch-Site": "same-origin"}
        assert httpx.post(f"{base}/dashboard/versions", cookies=cookie, data=rollback, headers=own).status_code == 303
        assert store.control(tmp_path / "adapters", "policy")["rollback"]["to"] == 0
        newline = httpx.post(f"{base}/dashboard/versions", cookies=cookie, headers=own,
                             data={"action": "pin", "version": "0", "tenant": "acme\n"})
        assert newline.status_code == 400 and not (tmp_path / "adapters" / "policy-acme\n").exists()
        summary = httpx.get(f"{base}/dashboard/api/summary", params={"tenant": "acme\n"}, cookies=cookie)
        assert summary.status_code == 400


def test_agent_keys_without_an_admin_key_disable_it_and_no_keys_open_it(engine, tmp_path):
    with live_gateway(engine, tmp_path / "a", 'gateway.api_keys=["agent-key"]') as (base, _):
        assert httpx.get(f"{base}/dashboard", headers={"Authorization": "Bearer agent-key"}).status_code == 403
        assert httpx.get(f"{base}/dashboard/api/summary").json()["error"]["code"] == "admin_disabled"
    with live_gateway(engine, tmp_path / "b") as (base, _):  # no keys: loopback only, open like every route
        page = httpx.get(f"{base}/dashboard")
        assert page.status_code == 200 and "no versions yet" not in page.text and "no sessions yet" in page.text


def test_line_chart_scales_points_and_says_when_empty():
    svg = line_chart("t", [Series("a", [(0, -1.0), (2, 1.0)], "s1"), Series("b", [], "s2")], x_label="v",
                     y_range=(-1.0, 1.0))
    assert 'data-series="1" data-points="2"' in svg and svg.count("<circle") == 2
    ys = [float(y) for y in re.findall(r'cy="([\d.]+)"', svg)]
    assert ys[0] > ys[1]  # -1 is drawn below +1 (SVG y grows downwards)
    assert "no data yet" in line_chart("t", [Series("a", [], "s1")], x_label="v")


CHROMIUM = "/usr/bin/chromium"  # Debian's package (bash scripts/install.sh --test installs it)
SERIES_RGB = [(0x2F, 0x6F, 0xDF), (0xE0, 0x89, 0x2B), (0x1F, 0x9D, 0x6B), (0x8A, 0x4F, 0xD6)]  # dashboard.css


def test_headless_chromium_signs_in_draws_the_curves_and_refreshes_live(trained, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (a test dependency)")
    if not __import__("os").path.exists(CHROMIUM):
        pytest.skip(f"no {CHROMIUM}: install Debian's chromium (bash scripts/install.sh --test does)")
    import numpy
    from PIL import Image

    base, _ = trained
    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(f"{base}/dashboard")
            page.fill("input[name=key]", ADMIN)
            assert errors == ["Failed to load resource: the server responded with a status of 401 (Unauthorized)"]
            errors.clear()  # the sign-in page itself is a 401; from here on nothing may fail
            page.click("button[type=submit]")
            page.wait_for_selector("[data-panel=curves] svg polyline")
            lines = page.locator("[data-panel=curves] polyline")
            assert lines.count() >= 3
            assert all((lines.nth(i).bounding_box() or {}).get("width", 0) > 50 for i in range(lines.count()))
            shot = tmp_path / "curves.png"
            page.locator("[data-panel=curves]").screenshot(path=str(shot))
            pixels = numpy.asarray(Image.open(shot).convert("RGB"), dtype=numpy.int32)
            coloured = int(sum((numpy.abs(pixels - rgb).sum(axis=-1) < 40).sum() for rgb in SERIES_RGB))
            assert coloured > 300, f"the curves drew only {coloured} series-coloured pixels"
            # Live: a new conversation shows up without a reload (the panels refresh every 5 s).
            chat(base, [{"role": "user", "content": "a brand new conversation"}], **{"X-Session-Id": "conv-live"})
            sync_api.expect(page.locator("[data-panel=sessions]")).to_contain_text("conv-live", timeout=20_000)
            page.click("text=conv-1")
            page.wait_for_selector("article.turn")
            assert "Answer in one short sentence." in page.content()
        finally:
            browser.close()
    assert not errors, errors  # a CSP violation or a script error would be logged here


def test_session_page_shows_a_turn_the_judge_gave_up_on_and_why(tmp_path):
    from types import SimpleNamespace

    from clawr1.gateway.dashboard import data, views
    from tests.unit.test_reward_worker import conversation

    with SQLitePool(tmp_path) as pool:
        conversation(pool, "hard", "Thanks <b>a lot</b>")
        conversation(pool, "flaky", "Thanks")
        for attempt in range(3):
            pool.judge_failed("hard-0", f"RuntimeError: judge <down> ({attempt})", 3, 0.01)
        pool.judge_failed("flaky-0", "TimeoutError: slow judge", 3, 0.01)
        gw = SimpleNamespace(pool=pool)
        html = views.session_page(data.session(gw, "hard", None), "note")
        assert "judge gave up after 3 failed attempts" in html and "RuntimeError: judge &lt;down&gt; (2)" in html
        flaky = views.session_page(data.session(gw, "flaky", None), "note")
        assert "judging failed 1 time, retrying; last error: TimeoutError: slow judge" in flaky


def test_a_web_page_in_a_real_browser_cannot_pin_or_post_feedback_on_an_open_gateway(engine, tmp_path):
    """A gateway with no keys, a page from elsewhere in Chromium: its auto-submitted form (pin v0)
    and its no-preflight `text/plain` feedback reach the gateway and are refused (403); the pin
    stays unset. (The dashboard's own forms, same-origin, sign in above.)"""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (a test dependency)")
    if not __import__("os").path.exists(CHROMIUM):
        pytest.skip(f"no {CHROMIUM}: install Debian's chromium (bash scripts/install.sh --test does)")
    from clawr1.engine import adapters as store

    with live_gateway(engine, tmp_path) as (base, _):
        statuses: dict[str, int] = {}
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--disable-gpu", "--no-first-run"])
            try:
                page = browser.new_page()
                page.on("response", lambda r: statuses.setdefault(r.url.split(base, 1)[-1], r.status))
                page.set_content(f"""<form id=f method=post action="{base}/dashboard/versions">
                    <input name=action value=pin><input name=version value=0></form>""")
                page.evaluate(f"""fetch("{base}/v1/feedback", {{method: "POST", mode: "no-cors",
                    headers: {{"Content-Type": "text/plain"}}, body: '{{"session_id": "x", "reward": -1}}'}})""")
                with page.expect_navigation():
                    page.evaluate("document.getElementById('f').submit()")
                page.wait_for_timeout(300)
            finally:
                browser.close()
        assert statuses.get("/dashboard/versions") == 403, statuses
        assert store.control(tmp_path / "adapters", "policy")["pinned"] is None
        assert httpx.get(f"{base}/dashboard").status_code == 200  # a program on this machine: still open
