"""`GET /metrics`: exact counter values after real requests, the levels read at scrape, and auth."""

from __future__ import annotations

import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.fake import FakeEngine
from clawr1.core.config import load_config
from clawr1.core.records import Step
from clawr1.datapool import SQLitePool
from clawr1.gateway.app import create_app
from clawr1.reward.types import Judgement
from clawr1.reward.worker import RewardWorker
from tests.conftest import run
from tests.gateway_helpers import live_gateway, wait_for

CHAT = "/v1/chat/completions"
ADMIN = "admin-key-0123456789abcdef"


def scrape(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a Prometheus text page, by (name, labels)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def ask(content: str, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0,
            **extra}


def test_metrics_count_requests_tokens_latency_and_queues(engine, tmp_path):
    with live_gateway(engine, tmp_path) as (base, pool), httpx.Client(base_url=base, timeout=60) as client:
        before = scrape(client.get("/metrics").text)  # the engine is the session's: its counters carry earlier tests'
        usages, first_id = [], None
        for i in range(2):
            reply = client.post(CHAT, json=ask(f"hello {i}"), headers={"X-Session-Id": f"private-session-{i}"})
            assert reply.status_code == 200
            usages.append(reply.json()["usage"])
            first_id = first_id or reply.json()["id"]
        with client.stream("POST", "/secret-path-session/p1" + CHAT,
                           json=ask("stream", stream=True, stream_options={"include_usage": True})) as streamed:
            events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: {")]
        usages.append(json.loads(events[-1])["usage"])
        assert client.post(CHAT, json={"messages": "not a list"}).status_code == 400
        assert client.get("/no/such/route").status_code == 404
        wait_for(lambda: pool.stats()["steps"] >= 3, what="3 recorded steps")
        assert client.post("/v1/feedback", json={"completion_id": first_id, "reward": 1}).status_code == 200

        page = client.get("/metrics")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
        m = scrape(page.text)

        assert value(m, "clawr1_requests_total", route=CHAT, status="200") == 2
        assert value(m, "clawr1_requests_total", route="/{session_id}/{prompt_id}" + CHAT, status="200") == 1
        assert value(m, "clawr1_requests_total", route=CHAT, status="400") == 1
        assert value(m, "clawr1_requests_total", route="unmatched", status="404") == 1
        assert value(m, "clawr1_request_duration_seconds_count", route=CHAT) == 3
        assert value(m, "clawr1_time_to_first_token_seconds_count") == 3  # the 400 never reached the engine
        assert 0 < value(m, "clawr1_time_to_first_token_seconds_sum") <= value(
            m, "clawr1_request_duration_seconds_sum", route=CHAT) + value(
            m, "clawr1_request_duration_seconds_sum", route="/{session_id}/{prompt_id}" + CHAT)
        assert value(m, "clawr1_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
        assert value(m, "clawr1_completion_tokens_total") == sum(u["completion_tokens"] for u in usages)
        # Every prompt token was either run or taken from the prefix cache (the chat template's shared start).
        cached, prefilled = ("clawr1_engine_prefix_cached_tokens_total", "clawr1_engine_prefill_tokens_total")
        assert value(m, cached) > value(before, cached)
        assert value(m, prefilled) - value(before, prefilled) + value(m, cached) - value(before, cached) == sum(
            u["prompt_tokens"] for u in usages)
        finished = sum(value(m, "clawr1_generations_total", finish_reason=r) or 0 for r in ("stop", "length"))
        assert finished == 3
        assert value(m, "clawr1_pool_ready_samples") == 1  # the turn the feedback rewarded
        assert value(m, "clawr1_gateway_inflight") == 0
        assert value(m, "clawr1_pool_pending_writes") == 0
        assert value(m, "clawr1_policy_version") == 0
        assert value(m, "clawr1_policy_swaps_total") == 0
        # Labels are route templates: no session id or path as sent becomes a series.
        assert "private-session" not in page.text and "secret-path-session" not in page.text
        assert "no/such/route" not in page.text
        # A scrape counts itself once it has answered: the one before the requests, then `page`.
        assert value(m, "clawr1_requests_total", route="/metrics", status="200") == 1
        assert value(scrape(client.get("/metrics").text), "clawr1_requests_total", route="/metrics", status="200") == 2


def test_metrics_need_the_admin_key_when_one_is_set(engine, tmp_path):
    overrides = (f'gateway.admin_key="{ADMIN}"', 'gateway.api_keys=["sk-agent-key"]')
    with live_gateway(engine, tmp_path, *overrides) as (base, _), httpx.Client(base_url=base) as client:
        assert client.get("/metrics").status_code == 401
        refused = client.get("/metrics", headers={"Authorization": "Bearer sk-agent-key"})
        assert refused.status_code == 401 and "admin key" in refused.json()["error"]["message"]
        assert client.get("/metrics", headers={"Authorization": "Bearer é-not-ascii".encode("latin-1")}).status_code == 401
        ok = client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
        assert ok.status_code == 200 and "clawr1_requests_total" in ok.text


def test_metrics_take_an_agent_key_when_no_admin_key_is_set_but_never_another_tenants(engine, tmp_path):
    """The exposition names every tenant's adapter: a tenant's key does not read it."""
    overrides = ('gateway.api_keys=["sk-agent-key"]', 'tenants.keys={acme=["sk-acme-key"]}')
    with live_gateway(engine, tmp_path, *overrides) as (base, _), httpx.Client(base_url=base) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"Authorization": "Bearer sk-agent-key"}).status_code == 200
        refused = client.get("/metrics", headers={"Authorization": "Bearer sk-acme-key"})
        assert refused.status_code == 401 and "gateway.admin_key" in refused.json()["error"]["message"]
    with live_gateway(engine, tmp_path / "only-tenants", 'tenants.keys={acme=["sk-acme-key"]}') as (base, _):
        assert httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer sk-acme-key"}).status_code == 401
        assert httpx.get(f"{base}/metrics").status_code == 401  # keys are set: not open


def _step(step_id: str, turn: int) -> Step:
    return Step(step_id=step_id, tenant="default", session_id="s", prompt_id="s", turn_index=turn, turn_type="main",
                messages=[{"role": "user", "content": f"q{turn}"}], tools=None, prompt_ids=[1], token_ids=[2],
                logprobs=[-0.5], text="a", policy_version=0, adapter=None, finish_reason="stop", temperature=1.0)


def test_served_version_swaps_and_judge_outcomes_are_read_at_scrape(tmp_path):
    config = load_config(None, [f'data_dir="{tmp_path}"', 'trainer.method="combine"'])
    with SQLitePool(tmp_path, config.pool) as pool:
        pool.append_steps([_step("a", 0), _step("b", 1)])
        engine = FakeEngine()
        app = create_app(engine, pool, config)
        gateway = app.state.gateway
        worker = RewardWorker(pool, None, config, judge=None)
        gateway.metrics.watch_judge(worker)

        async def main() -> str:
            await engine.load_adapter("policy", tmp_path)  # the fake engine serves "policy" v1 from now on
            gateway.swaps.append((time.time(), 1, 0.25))
            await worker.store("a", Judgement(1, [1, 1, 1], ["+1"] * 3, "judge majority", "judge", None,
                                              "no_correction"))
            await worker.store("b", Judgement(-1, [-1], ["-1"], "traceback", "rule", "Check the path first, please.",
                                              None))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
                return (await client.get("/metrics")).text

        m = scrape(run(main()))
        assert value(m, "clawr1_policy_version") == 1
        assert value(m, "clawr1_policy_swaps_total") == 1
        assert value(m, "clawr1_policy_swap_load_seconds_total") == 0.25
        assert value(m, "clawr1_judge_outcomes_total", score="1", source="judge") == 1
        assert value(m, "clawr1_judge_outcomes_total", score="-1", source="rule") == 1
        assert value(m, "clawr1_judge_hints_total", result="accepted") == 1
        assert value(m, "clawr1_judge_hints_total", result="no_correction") == 1
        assert value(m, "clawr1_judge_errors_total") == 0
        assert value(m, "clawr1_pool_ready_samples") == 2  # both turns got a non-zero reward
