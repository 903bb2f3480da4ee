"""The SGLang engine against SGLang's documented native API (`tests/sglang_fake.py`: the API in
front of the real local engine, strict about fields), and through the gateway."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from clawr1.core.config import EngineConfig
from clawr1.core.types import EngineFailure, SamplingParams
from clawr1.engine import adapters as store
from clawr1.engine.sglang import SGLangEngine
from tests.conftest import run
from tests.gateway_helpers import free_port, live_gateway, steps_of
from tests.unit.test_adapters import make_adapter


@contextlib.asynccontextmanager
async def sglang(url, tiny_model_dir):
    engine = SGLangEngine(tiny_model_dir, EngineConfig(backend="sglang", url=url))
    try:
        yield engine
    finally:
        await engine.close()


def test_sampled_ids_logprobs_and_scores_are_the_servers_exactly(served, tiny_model_dir):
    url, app, backend = served

    async def go():
        async with sglang(url, tiny_model_dir) as engine:
            prompt = engine.render([{"role": "user", "content": "Hello there"}])
            gen = await engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.8, seed=7)).final()
            assert len(gen.token_ids) == len(gen.logprobs) > 0 and gen.finish_reason in ("stop", "length")
            teacher = await backend.score(prompt, gen.token_ids, temperature=0.8)
            assert gen.logprobs == pytest.approx(teacher, abs=1e-4)
            assert await engine.score(prompt, gen.token_ids) == pytest.approx(
                await backend.score(prompt, gen.token_ids), abs=1e-6)
            with pytest.raises(Exception, match="temperature 1"):
                await engine.score(prompt, gen.token_ids, temperature=0.5)
        kinds = [body for kind, body in app.state.requests if kind == "generate"]
        assert kinds[0]["input_ids"] == prompt and kinds[0]["return_logprob"] is True
        assert kinds[0]["sampling_params"]["sampling_seed"] == 7

    asyncio.run(go())


def test_lora_versions_load_swap_under_a_request_and_retire(served, tiny_model_dir, tmp_path):
    url, app, backend = served

    async def go():
        async with sglang(url, tiny_model_dir) as engine:
            prompt = engine.render([{"role": "user", "content": "Hi"}])
            assert await engine.load_adapter("policy", make_adapter(tiny_model_dir, tmp_path, 1, seed=0)) == 1
            running = engine.generate(prompt, SamplingParams(max_tokens=30, temperature=1.0), adapter="policy")
            await asyncio.sleep(0)
            assert await engine.load_adapter("policy", make_adapter(tiny_model_dir, tmp_path, 2, seed=1)) == 2
            after = await engine.generate(prompt, SamplingParams(max_tokens=3), adapter="policy").final()
            assert ((await running.final()).version, after.version) == (1, 2)
            for _ in range(50):
                if ("unload", {"lora_name": "policy@v1"}) in app.state.requests:
                    break
                await asyncio.sleep(0.02)
        calls = [(kind, body.get("lora_name") or body.get("lora_path")) for kind, body in app.state.requests]
        assert ("load", "policy@v1") in calls and ("load", "policy@v2") in calls and ("unload", "policy@v1") in calls
        assert ("generate", "policy@v2") in calls and ("unload", "policy@v2") not in calls

    asyncio.run(go())


def test_the_gateway_records_sglang_tokens_and_a_dead_server_is_a_502(served, tiny_model_dir, tmp_path):
    url, _, backend = served
    engine = SGLangEngine(tiny_model_dir, EngineConfig(backend="sglang", url=url))
    with live_gateway(engine, tmp_path) as (base, pool):
        reply = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6, "temperature": 0})
        assert reply.status_code == 200
        [step] = steps_of(pool, 1)
        assert step.prompt_ids == engine.render([{"role": "user", "content": "Say hi"}])
        assert step.logprobs == pytest.approx(run(backend.score(step.prompt_ids, step.token_ids)), abs=1e-4)
    dead = SGLangEngine(tiny_model_dir, EngineConfig(backend="sglang", url=f"http://127.0.0.1:{free_port()}"))
    with live_gateway(dead, tmp_path / "dead") as (base, _):
        reply = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6})
        assert reply.status_code == 502 and reply.json()["error"]["code"] == "engine_failure"


def test_full_weights_update_from_disk_and_generations_carry_their_version(served, tiny_model_dir, tmp_path):
    url, app, backend = served
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)  # different weights, same shapes
    published = store.publish_weights(model, tmp_path / "weights", "policy", 3)

    async def go():
        async with sglang(url, tiny_model_dir) as engine:
            prompt = engine.render([{"role": "user", "content": "Hi"}])
            before = await engine.generate(prompt, SamplingParams(max_tokens=4)).final()
            assert await engine.load_weights(published) == 3 and engine.weights_version() == 3
            after = await engine.generate(prompt, SamplingParams(max_tokens=4)).final()
            assert (before.version, after.version) == (0, 3)  # told by the server's weight_version
    asyncio.run(go())
    assert ("weights", {"model_path": str(published.resolve()), "weight_version": "3"}) in app.state.requests
    assert backend.weights_version() == 3


def test_an_engine_failure_is_not_a_crash(tiny_model_dir):
    async def go():
        async with sglang(f"http://127.0.0.1:{free_port()}", tiny_model_dir) as engine:
            stream = engine.generate(engine.render([{"role": "user", "content": "x"}]), SamplingParams(max_tokens=2))
            with pytest.raises(EngineFailure):
                await stream.final()
    asyncio.run(go())
