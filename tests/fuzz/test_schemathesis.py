"""The fuzz tier: schemathesis generates requests from the gateway's own `/openapi.json` (valid
ones, and invalid ones in every field) against a live gateway with a scripted engine, over every
route. Pass means: no answer >= 500 except 502/503/504 with an error body, every error body in its
API's shape, nothing left in flight, the server healthy after, and the pool holding exactly the
steps of the requests that were served. The hand-written hostile cases are in
`tests/unit/test_gateway_hostile.py`."""

from __future__ import annotations

import json
from typing import Any

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.gateway_helpers import live_gateway, wait_for
from tests.scripted_engine import ScriptedEngine
from tests.unit.test_gateway_hostile import ADMIN, anthropic_shaped, inflight, openai_shaped

EXAMPLES = 15  # per operation and generation mode: ~1,100 requests, ~70 s on 2 cores (40 made ~3,000, 190 s)
# Generation routes, with /v1 and without (`/{session}/{prompt}/chat/completions`, Claw-R1's base URL).
GENERATING = ("/chat/completions", "/completions", "/v1/messages", "/responses")


def content_type(response: Any) -> str:
    value = response.headers.get("content-type") or ""
    return value[0] if isinstance(value, list) else value  # schemathesis keeps every value of a header


def steps_served(path: str, response: Any) -> int:
    """Steps a 200 answer of a generation route stored: one per choice (streams: one)."""
    if response.status_code != 200 or not path.endswith(GENERATING):
        return 0
    if content_type(response).startswith("text/event-stream"):
        return 1
    body = response.json()
    return len(body["choices"]) if "choices" in body else 1


def check(path: str, response: Any) -> None:
    status = response.status_code
    assert status < 500 or status in (502, 503, 504), f"{path}: {status} {response.text[:500]}"
    if status < 400 or path.startswith("/dashboard"):  # the dashboard answers in HTML (sign-in page)
        return
    body = response.json()
    shaped = anthropic_shaped if path.endswith("/v1/messages") else openai_shaped
    assert shaped(body), f"{path}: {status} {response.text[:500]}"


def test_schemathesis_over_every_route(engine, tmp_path):
    scripted = ScriptedEngine(engine, "Hello there, friend.")
    with live_gateway(scripted, tmp_path, f'gateway.admin_key="{ADMIN}"', "gateway.max_body_bytes=65536") as (
            base, pool), httpx.Client(base_url=base, timeout=30) as client:
        schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
        session = requests.Session()
        session.headers["Authorization"] = f"Bearer {ADMIN}"
        served = {"steps": 0, "calls": 0}
        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) >= 20  # every route is in the schema, generation routes with their bodies
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(generation_mode=mode))
                def fuzz(case: Any) -> None:
                    response = case.call(base_url=base, session=session, timeout=30)
                    check(case.formatted_path, response)
                    served["steps"] += steps_served(case.formatted_path, response)
                    served["calls"] += 1

                try:
                    fuzz()
                except Unsatisfiable:
                    assert mode is GenerationMode.NEGATIVE  # nothing to break in a route without inputs
        assert served["calls"] > 600
        assert wait_for(lambda: inflight(client) == 0, what="inflight back to 0")
        assert client.get("/healthz").status_code == 200
        wait_for(lambda: pool.stats()["steps"] >= served["steps"], what="every served step committed")
        assert pool.stats()["steps"] == served["steps"]
        print(json.dumps(served))
