"""The gateway benchmark's fakes and a tiny end-to-end run (seconds, no model)."""

import io
import json

from fastapi.testclient import TestClient
from rich.console import Console

from benchmarks import gateway as bench
from benchmarks.fake import PIECES, REPLY, REPLY_IDS, REPLY_LOGPROBS, FakeEngine
from clawr1.core.config import load_config
from clawr1.core.types import SamplingParams
from clawr1.datapool import SQLitePool
from clawr1.gateway.app import create_app
from tests.conftest import run

MESSAGES = [{"role": "user", "content": "Hello?"}]


def test_fake_stream_is_a_token_faithful_generation():
    engine = FakeEngine()

    async def go():
        full = await engine.generate([1, 2], SamplingParams()).final()
        short = await engine.generate([1, 2], SamplingParams(max_tokens=4)).final()
        stream = engine.generate([1, 2], SamplingParams())
        events = [await stream.__anext__() for _ in range(3)]
        stream.cancel()
        return full, short, events, await stream.final()

    full, short, events, cancelled = run(go())
    assert full.token_ids == list(REPLY_IDS) and full.logprobs == list(REPLY_LOGPROBS)
    assert full.text == full.content == REPLY == engine.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    assert full.finish_reason == "stop" and full.prompt_ids == [1, 2] and full.version == 0
    assert short.finish_reason == "length" and short.text == "".join(PIECES[:4])
    assert [e.text for e in events] == list(PIECES[:3])
    assert cancelled.finish_reason == "aborted" and cancelled.token_ids == list(REPLY_IDS[:3])


def test_gateway_serves_and_records_the_fake_engine(tmp_path):
    config = load_config(None, [f'data_dir="{tmp_path}"'])
    pool = SQLitePool(tmp_path, config.pool)
    with TestClient(create_app(FakeEngine(), pool, config), base_url="http://localhost") as client:  # no keys: loopback names
        reply = client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "logprobs": True})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["choices"][0]["message"]["content"] == REPLY
        assert [c["logprob"] for c in body["choices"][0]["logprobs"]["content"]] == list(REPLY_LOGPROBS)
        assert body["usage"]["completion_tokens"] == len(REPLY_IDS)
        with client.stream("POST", "/v1/chat/completions",
                           json={"model": "m", "messages": MESSAGES, "stream": True}) as streamed:
            lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == REPLY
    pool.close()  # commits what the gateway queued
    pool = SQLitePool(tmp_path, config.pool)
    try:
        assert pool.stats()["steps"] == 2
    finally:
        pool.close()


def test_benchmark_smoke_measures_every_target_with_recording_on(tmp_path):
    config = load_config(None, [f'data_dir="{tmp_path}"'])
    out = io.StringIO()
    numbers = bench.run(config, Console(file=out, width=120), requests=20, concurrency=(1, 4),
                        include_litellm=False, seconds=2.0, workers=2, rounds=2, profile=5)
    assert set(numbers["targets"]) == {"direct", "passthrough", "gateway", "gateway x2"}
    for name, modes in numbers["targets"].items():
        for mode in ("plain", "stream"):
            for c in ("1", "4"):
                cell = modes[mode][c]
                assert cell["errors"] == 0 and cell["req_s"] > 0, (name, mode, c, cell)
                assert cell["n"] == 2 * 20  # both rounds, each its 20 requests
                assert cell["p99_ms"] >= cell["p50_ms"] > 0
                if name != "direct":
                    assert "added_p50_ms" in cell
    assert {"cpu_ms_at_4", "req_s_vs_passthrough_at_4", "req_s_vs_passthrough_at_4, stream",
            "added_p50_ms_at_1"} <= set(numbers["goals"])
    for mode in ("plain", "stream"):  # ours ÷ the pass-through's req/s in each round, and their median
        ratio = numbers["round_ratios"][mode]["4"]
        assert len(ratio["rounds"]) == 2 and min(ratio["rounds"]) <= ratio["median"] <= max(ratio["rounds"])
    assert numbers["goals"]["req_s_vs_passthrough_at_4, stream"]["value"] == numbers["round_ratios"]["stream"]["4"]["median"]
    profile = numbers["profile"]  # one more gateway, profiled: its costliest functions, the loop's own time apart
    assert len(profile["top"]) == 5 and profile["requests"] > 2 * 20 and profile["loop_s"] > 0
    assert all(row["own_s"] > 0 and 0 < row["share"] <= 1 for row in profile["top"])
    assert any(row["area"].startswith("clawr1/gateway/") for row in profile["areas"])  # the same time by file
    assert "Where the gateway's time goes" in out.getvalue() and "round by round" in out.getvalue()
    recording = numbers["recording"]
    # Every answered request (readiness probe, warm-ups, measured) is a committed step of the gateway's pool.
    assert recording["ok"] and recording["recorded_steps"] == recording["served"] > 4 * 20
    several = numbers["recording_workers"]  # gateway.workers = 2, as `clawr1 serve` runs it: all recorded too
    assert several["ok"] and several["recorded_steps"] == several["served"] > 4 * 20
    assert set(numbers["scaling"]) == {"plain", "stream"} and "gateway.workers = 2" in out.getvalue()
    assert set(numbers["ratios"]) == {"passthrough"}
    assert "LiteLLM" not in out.getvalue() and "passthrough" in out.getvalue()
    json.dumps(numbers)  # JSON-serialisable, for `clawr1 bench gateway --json`
    assert not list(tmp_path.iterdir())  # the benchmark records into its own temporary pool, not data_dir


def test_ratios_to_the_pass_through_are_taken_round_by_round():
    ratio = bench._round_ratios([100.0, 300.0, 200.0], [400.0, 400.0, 0.0])
    assert ratio == {"rounds": [0.25, 0.75, None], "median": 0.5}  # a round it served nothing in has no ratio


def test_a_cell_over_rounds_takes_each_numbers_median():
    runs = [{"n": 10, "errors": 0, "req_s": 100.0, "cpu_ms": 0.30},
            {"n": 10, "errors": 1, "req_s": 300.0, "cpu_ms": 0.20, "first_error": "HTTP 500: b''"},
            {"n": 10, "errors": 0, "req_s": 200.0, "cpu_ms": 0.25}]
    cell = bench._median_cell(runs)
    assert cell == {"n": 30, "errors": 1, "req_s": 200.0, "cpu_ms": 0.25, "first_error": "HTTP 500: b''"}
