"""The exact-maths checks of the engine and the trainer, on a tiny random model of Qwen2.5's shape
(attention biases, an untied head) with Qwen2.5-Coder's real tokenizer, chat template and
recommended sampling (temperature 0.7, top_p 0.8, top_k 20): tool calls render and parse in its
template's convention, the engine's logprobs are what `score` and the trainer compute, a training
step moves every adapter matrix (and no head), and the engine serving the published adapter
reproduces the trainer's logprobs."""

from __future__ import annotations

import json

import pytest
import torch

from clawr1.core.config import EngineConfig, load_config
from clawr1.core.records import Reward, Step
from clawr1.core.types import SamplingParams
from clawr1.datapool import SQLitePool
from clawr1.engine import adapters
from clawr1.engine.local import LocalEngine
from clawr1.trainer.loop import Trainer
from clawr1.trainer.policy import ADAPTER, pack
from tests.conftest import run

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string"}}, "required": ["expression"]}}}]


@pytest.fixture(scope="module")
def qwen(tiny_qwen_dir):
    engine = LocalEngine.load(tiny_qwen_dir, EngineConfig(threads=1, max_batch=4))
    yield engine
    run(engine.close())


def recommended(engine, seed: int, max_tokens: int = 16) -> SamplingParams:
    d = engine.sampling_defaults
    return SamplingParams(max_tokens=max_tokens, temperature=d.temperature, top_p=d.top_p, top_k=d.top_k, seed=seed)


def test_its_template_renders_tools_and_its_calls_parse(qwen):
    assert (qwen.sampling_defaults.temperature, qwen.sampling_defaults.top_p, qwen.sampling_defaults.top_k) == (
        0.7, 0.8, 20)
    history = [{"role": "user", "content": "What is 27 * 52?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "calculator",
                                                                 "arguments": '{"expression": "27 * 52"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "1404"}]
    text = qwen.tokenizer.decode(qwen.render(history, TOOLS))
    assert "<tools>" in text and '"name": "calculator"' in text  # the template's own tool section
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "27 * 52"}}\n</tool_call>' in text
    assert "<tool_response>\n1404\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    parsed = qwen.parse('<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>')
    assert parsed.content is None and [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("calculator", {"expression": "3 + 4"})]


def test_logprobs_at_its_recommended_sampling_are_what_score_computes_alone_and_batched(qwen):
    prompts = [qwen.render([{"role": "user", "content": "word " * (3 * i + 1)}]) for i in range(4)]

    async def go():
        gens = await asyncio_gather([qwen.generate(p, recommended(qwen, i)).final() for i, p in enumerate(prompts)])
        d = qwen.sampling_defaults
        return gens, [await qwen.score(p, g.token_ids, temperature=d.temperature, top_k=d.top_k, top_p=d.top_p)
                      for p, g in zip(prompts, gens)]

    gens, scores = run(go())
    for gen, scored in zip(gens, scores):
        assert (gen.temperature, gen.top_p, gen.top_k) == (0.7, 0.8, 20) and len(gen.token_ids) > 0
        assert max(abs(a - b) for a, b in zip(gen.logprobs, scored)) <= 1e-3
        assert qwen.tokenizer.decode(gen.token_ids, skip_special_tokens=True) == gen.text


async def asyncio_gather(coroutines):
    import asyncio

    return await asyncio.gather(*coroutines)


def test_the_trainer_matches_the_engine_then_a_step_moves_every_adapter_and_the_engine_serves_it(
        qwen, tiny_qwen_dir, tmp_path):
    messages = [[{"role": "user", "content": f"Question {i}: say something."}] for i in range(4)]

    async def sampled():
        return await asyncio_gather([qwen.generate(qwen.render(m), recommended(qwen, i, 10)).final()
                                     for i, m in enumerate(messages)])

    gens = run(sampled())
    config = load_config(None, [f'data_dir="{tmp_path}"', f'engine.model="{tiny_qwen_dir}"', "trainer.batch_size=4",
                                "trainer.max_wait_s=0", "trainer.lr=0.02", "trainer.epochs=2", 'trainer.method="rl"',
                                "trainer.kl_coef=0", "guard.enabled=false"])
    with SQLitePool(tmp_path, config.pool) as pool:
        for i, (m, gen) in enumerate(zip(messages, gens)):
            pool.append_step(Step(step_id=f"q-{i}", tenant="default", session_id=f"s{i}", prompt_id=f"s{i}",
                                  turn_index=0, turn_type="main", messages=m, tools=None, prompt_ids=gen.prompt_ids,
                                  token_ids=gen.token_ids, logprobs=gen.logprobs, text=gen.text, policy_version=0,
                                  adapter=None, finish_reason=gen.finish_reason, temperature=gen.temperature,
                                  top_p=gen.top_p, top_k=gen.top_k))
            pool.add_reward(Reward(step_id=f"q-{i}", score=1.0 if i % 2 == 0 else -1.0, source="test"))
        trainer = Trainer(config, pool)
        policy = trainer.policy

        def logprobs() -> torch.Tensor:
            rows = pack([g.prompt_ids for g in gens], [g.token_ids for g in gens], [0.7] * 4, policy.pad_id,
                        [(20, 0.8)] * 4)
            return policy.logprobs(rows)

        k = logprobs().shape[1]
        for row, gen in zip(logprobs(), gens):  # the importance ratio is 1 at v0, the untied head included
            assert row[k - len(gen.token_ids):].tolist() == pytest.approx(gen.logprobs, abs=1e-3)
        before = {n: p.detach().clone() for n, p in policy.named_trainable().items()}
        head = policy.head.detach().clone()
        assert trainer.run_once()["version"] == 1  # two optimizer steps: LoRA's B first, then A too
        changed = [n for n, p in policy.named_trainable().items() if not torch.equal(p, before[n])]
        assert len(changed) == len(before) and not any("lm_head" in n for n in before)
        assert torch.equal(policy.head, head)  # the head takes no adapter
        moved = [(row[k - len(g.token_ids):].sum() - sum(g.logprobs)).item() for row, g in zip(logprobs(), gens)]
        assert moved[0] + moved[2] > moved[1] + moved[3]  # rewarded replies gained on the punished ones
        trained = logprobs()
    _, path = adapters.latest(tmp_path / "adapters", ADAPTER)
    run(qwen.load_adapter("policy", path))
    try:
        d = qwen.sampling_defaults
        served = [run(qwen.score(g.prompt_ids, g.token_ids, "policy", d.temperature, d.top_k, d.top_p)) for g in gens]
    finally:
        run(qwen.unload_adapter("policy"))
    for row, gen, scored in zip(trained, gens, served):
        assert row[k - len(gen.token_ids):].tolist() == pytest.approx(scored, abs=1e-3)
