"""Full fine-tuning (`trainer.finetune = "full"`): every weight trains, whole models are published
with the same marker discipline as adapters, and the engine swaps them between batches: requests
running finish on the old weights, queued ones wait, none fail; the gateway serves the new
version the moment it is in."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
import torch

from clawr1.core.config import EngineConfig, load_config
from clawr1.core.types import SamplingParams
from clawr1.datapool import SQLitePool
from clawr1.engine import adapters as store
from clawr1.engine.local import LocalEngine
from clawr1.trainer.loop import Trainer
from tests.conftest import run
from tests.gateway_helpers import live_gateway, steps_of, wait_for
from tests.unit.test_trainer import config_for, fill


@pytest.fixture
def own_engine(tiny_model_dir):
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, max_batch=8))
    yield engine
    run(engine.close())


def test_a_full_step_moves_the_weights_and_publishes_a_whole_model(tiny_model_dir, tmp_path, generations):
    config = config_for(tiny_model_dir, tmp_path, 'trainer.finetune="full"', "trainer.lr=1e-3")
    with SQLitePool(tmp_path, config.pool) as pool:
        fill(pool, generations)
        trainer = Trainer(config, pool)
        before = {n: p.detach().clone() for n, p in trainer.policy.named_trainable().items()}
        assert len(before) == len(list(trainer.policy.model.parameters()))  # every weight, no adapter
        metrics = trainer.run_once()
        trainer.close()
    moved = {n for n, p in trainer.policy.named_trainable().items() if not torch.equal(p, before[n])}
    assert moved == set(before)  # every tensor moved (Adam's first step moves all with a gradient)
    path = store.latest(tmp_path / "weights", "policy")[1]
    assert metrics["version"] == 1 and store.read_weights_marker(path)["version"] == 1
    assert {"config.json", "model.safetensors", "STABLE"} <= {f.name for f in path.iterdir()}
    assert not (tmp_path / "adapters").exists()


def test_the_engine_swaps_weights_between_batches_and_nothing_fails(own_engine, tiny_model_dir, tmp_path):
    engine = own_engine
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.9)
    path = store.publish_weights(model, tmp_path / "weights", "policy", 1)

    async def go():
        prompt = engine.render([{"role": "user", "content": "Hello"}])
        running = engine.generate(prompt, SamplingParams(max_tokens=60, temperature=1.0, seed=1))
        await running.__anext__()  # it is decoding
        swap = asyncio.ensure_future(engine.load_weights(path))
        await asyncio.sleep(0.01)
        queued = engine.generate(prompt, SamplingParams(max_tokens=5, temperature=1.0, seed=2))  # waits the drain
        old, version = await running.final(), await swap
        new = await queued.final()
        assert version == 1 and engine.weights_version() == 1
        assert (old.version, new.version) == (0, 1) and {old.finish_reason, new.finish_reason} <= {"stop", "length"}
        # Each was sampled by the weights it is labelled with: rescored now (v1) only the new one agrees.
        assert await engine.score(prompt, new.token_ids) == pytest.approx(new.logprobs, abs=1e-4)
        assert await engine.score(prompt, old.token_ids) != pytest.approx(old.logprobs, abs=1e-4)
    run(go())


def test_a_second_weights_load_queued_before_the_first_is_applied_answers_both(own_engine, tiny_model_dir,
                                                                                tmp_path):
    engine = own_engine
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    paths = []
    for version in (1, 2):
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(0.9)
        paths.append(store.publish_weights(model, tmp_path / "weights", "policy", version))

    async def go():
        prompt = engine.render([{"role": "user", "content": "Hello"}])
        running = engine.generate(prompt, SamplingParams(max_tokens=400, temperature=1.0, seed=1))
        await running.__anext__()  # decoding: both loads wait for this batch to drain
        first = asyncio.ensure_future(engine.load_weights(paths[0]))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(engine.load_weights(paths[1]))
        await asyncio.sleep(0.05)
        assert running._request.gen.finish_reason is None, "the batch drained before both loads were queued"
        versions = await asyncio.wait_for(asyncio.gather(first, second), timeout=30)  # none waits forever
        assert versions == [2, 2] and engine.weights_version() == 2  # the newer one is applied, once
        assert engine.stats["weight_swaps"] == 1
        assert (await running.final()).version == 0
    run(go())


def test_a_stream_queued_across_a_swap_names_the_weights_that_sample_it(own_engine, tiny_model_dir, tmp_path):
    """Admitted while v0 serves, sampled after v1 is in: its content and final chunks name v1, as
    its recorded step does (only what went out before sampling began can name v0)."""
    import json

    from transformers import AutoModelForCausalLM

    engine = own_engine
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.9)
    path = store.publish_weights(model, tmp_path / "published", "policy", 1)  # not where the gateway looks
    with live_gateway(engine, tmp_path / "data") as (base, pool):
        async def go():
            prompt = engine.render([{"role": "user", "content": "Hello"}])
            running = engine.generate(prompt, SamplingParams(max_tokens=400, temperature=1.0, seed=1))
            await running.__anext__()  # decoding: the load waits for this batch to drain
            swap = asyncio.ensure_future(engine.load_weights(path))
            await asyncio.sleep(0.05)
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
            raw = {"model": "m", "prompt": "Hello", "max_tokens": 4, "stream": True}
            async with httpx.AsyncClient(timeout=60) as client:
                replies = await asyncio.gather(client.post(f"{base}/v1/chat/completions", json=chat),
                                               client.post(f"{base}/v1/completions", json=raw))
            assert running._request.gen.finish_reason is not None and await swap == 1
            return replies
        chunks = [[json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
                  for reply in run(go())]
        # The chat stream's role chunk went out at admission: proof that both were queued.
        assert chunks[0][0]["system_fingerprint"] == "clawr1-v0", "admitted after the swap: not the case tested"
        for stream in chunks:  # keep-alive chunks while it queued may name v0; from the first token on, v1
            first = next(i for i, c in enumerate(stream) if c["choices"] and (
                c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text")))
            assert {c["system_fingerprint"] for c in stream[first:]} == {"clawr1-v1"}
        assert [step.policy_version for step in steps_of(pool, 2)] == [1, 1]


def test_the_gateway_serves_each_new_full_version(own_engine, tiny_model_dir, tmp_path, generations):
    overrides = ['trainer.finetune="full"', "gateway.adapter_poll_s=0.05", f'engine.model="{tiny_model_dir}"',
                 "trainer.batch_size=3", "trainer.max_wait_s=0", "trainer.lr=1e-3"]
    with live_gateway(own_engine, tmp_path, *overrides) as (base, pool):
        fill(pool, generations)
        config = load_config(None, [f'data_dir="{tmp_path}"', *overrides])
        with SQLitePool(tmp_path, config.pool) as trainer_pool:
            trainer = Trainer(config, trainer_pool)
            assert trainer.run_once()["version"] == 1
            trainer.close()
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        wait_for(lambda: httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30).json()["system_fingerprint"]
                 == "clawr1-v1", what="v1's weights served")
        assert httpx.get(f"{base}/metrics").text.count("clawr1_policy_version 1.0") == 1


def test_full_finetuning_with_the_guard_on_says_it_is_not_guarded(tiny_model_dir, tmp_path, caplog):
    for finetune in ("lora", "full"):
        config = config_for(tiny_model_dir, tmp_path / finetune, f'trainer.finetune="{finetune}"', "guard.enabled=true")
        with SQLitePool(tmp_path / finetune, config.pool) as pool, caplog.at_level("WARNING"):
            Trainer(config, pool).close()
        assert ("full fine-tuning is not guarded" in caplog.text) == (finetune == "full")


def test_full_finetuning_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="adapter_per_tenant"):
        load_config(None, ['trainer.finetune="full"', "tenants.adapter_per_tenant=true"])
    with pytest.raises(ValueError, match="vLLM"):
        load_config(None, ['trainer.finetune="full"', 'engine.backend="vllm"', 'engine.url="http://x"'])


def test_a_weights_load_waits_for_a_chunked_prefill_in_progress(tiny_model_dir, tmp_path):
    """A prompt half prefilled on the old weights finishes on them: the load waits for it, as it
    waits for the running batch (a swap between two chunks would mix two models in one cache).
    Its one token ends it at once, and it is not decoded again while the load waits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.9)
    path = store.publish_weights(model, tmp_path / "weights", "policy", 1)
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, prefill_chunk=16, prefix_cache_mb=0))

    async def go():
        long_prompt = engine.render([{"role": "user", "content": "word " * 480}])[:480]
        greedy = SamplingParams(max_tokens=1, temperature=0)
        reference = await engine.generate(long_prompt, greedy).final()
        before = engine.stats["prefill_tokens"]
        stream = engine.generate(long_prompt, greedy)
        while engine.stats["prefill_tokens"] == before:  # its first chunk is in
            await asyncio.sleep(0.001)
        queued = engine.generate(long_prompt[:8], greedy)  # waits behind it, then for the load
        await asyncio.sleep(0.01)
        swap = asyncio.ensure_future(engine.load_weights(path))
        gen = await stream.final()
        assert await swap == 1 and engine.weights_version() == 1
        assert (await queued.final()).version == 1
        assert gen.version == 0 and gen.token_ids == reference.token_ids and len(gen.token_ids) == 1
        assert gen.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
        await engine.close()
    run(go())


def test_full_fine_tuning_in_bfloat16_is_mixed_precision_over_float32_master_weights(tiny_model_dir, tmp_path,
                                                                                    generations):
    """`trainer.dtype = "bfloat16"` with full fine-tuning: every trained weight (and AdamW's state)
    stays float32, the decoder computes in bfloat16 under autocast, the frozen base kept for the
    KL is stored in bfloat16, and the update points where float32's does."""
    updates = {}
    for dtype in ("float32", "bfloat16"):
        config = config_for(tiny_model_dir, tmp_path / dtype, 'trainer.finetune="full"', f'trainer.dtype="{dtype}"',
                            "trainer.lr=1e-3", "trainer.kl_coef=0.1", "trainer.grad_clip=1000")
        with SQLitePool(tmp_path / dtype, config.pool) as pool:
            fill(pool, generations)
            trainer = Trainer(config, pool)
            policy = trainer.policy
            assert {p.dtype for p in policy.parameters()} == {torch.float32}  # master weights
            linear = {n for n, m in policy._reference.get_decoder().named_modules() if isinstance(m, torch.nn.Linear)}
            stored = {p.dtype for n, p in policy._reference.get_decoder().named_parameters() if n.rsplit(".", 1)[0] in linear}
            assert stored == {getattr(torch, dtype)}  # the kept base's linear weights: half the memory in bfloat16
            ids = torch.tensor([[1, 5, 9, 14, 2, 7]])
            with torch.no_grad(), policy._mixed_precision():  # step 0: the kept base computes what the policy does
                logits = policy.causal_lm(input_ids=ids).logits
                with policy.adapter_off():
                    assert torch.equal(policy.causal_lm(input_ids=ids).logits, logits)  # a KL of exactly 0
            before = {n: p.detach().clone() for n, p in policy.named_trainable().items()}
            computed: set[torch.dtype] = set()
            proj = policy.causal_lm.get_decoder().layers[0].self_attn.q_proj
            hook = proj.register_forward_hook(lambda _m, _i, out, _seen=computed: _seen.add(out.dtype))
            metrics = trainer.run_once()
            hook.remove()
            trainer.close()
        assert computed == {getattr(torch, dtype)} and metrics["version"] == 1 and math.isfinite(metrics["loss"])
        assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.optimizer.state.values())
        from safetensors import safe_open

        with safe_open(str(store.latest(tmp_path / dtype / "weights", "policy")[1] / "model.safetensors"), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {getattr(torch, dtype)}  # served as it computes
        updates[dtype] = torch.cat([(p.detach() - before[n]).flatten() for n, p in sorted(policy.named_trainable().items())])
    assert updates["bfloat16"].abs().max() > 0
    assert torch.cosine_similarity(updates["bfloat16"], updates["float32"], dim=0) > 0.9
