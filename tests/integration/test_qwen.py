"""The real embedded Qwen2.5-Coder-0.5B-Instruct: assembled from its six PyPI chunks, checked against
its SHA256 and converted once (the real first use), with its authors' recommended sampling; the
engine's logprobs at that sampling are what `score` computes, and given a tool it calls it (in its
template's tags or as the bare JSON it mostly writes, both parsed). Kept to one conversion and a
few short generations: the model decodes ~5-7 tokens/s on one thread of this machine."""

from __future__ import annotations

import asyncio
import json

import pytest

from clawr1.core.config import EngineConfig
from clawr1.core.types import SamplingParams
from clawr1.engine.local import LocalEngine
from clawr1.engine.models import EMBEDDED, MARKER, list_models, resolve_model

QWEN = "qwen2.5-coder-0.5b-instruct"
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string"}}, "required": ["expression"]}}}]


@pytest.fixture(scope="module")
def qwen(real_data_dir):
    path = resolve_model(QWEN, real_data_dir)  # ~90 s: six chunks, a SHA256, the dequantisation
    engine = LocalEngine.load(path, EngineConfig(threads=2, max_batch=4))
    yield path, engine
    asyncio.run(engine.close())


def test_it_converts_once_with_its_recommended_sampling(qwen, real_data_dir):
    path, engine = qwen
    assert "format 2" in (path / MARKER).read_text()
    assert not list(path.glob("*.gguf"))  # the assembled file is not kept beside the weights
    generation = json.loads((path / "generation_config.json").read_text())
    assert {k: generation[k] for k in ("temperature", "top_p", "top_k")} == EMBEDDED[QWEN].sampling
    d = engine.sampling_defaults
    assert (d.temperature, d.top_p, d.top_k) == (0.7, 0.8, 20)
    assert {i.name: i.status for i in list_models(real_data_dir)}[QWEN].startswith("ready")
    config = json.loads((path / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["num_hidden_layers"] == 24


def test_logprobs_at_its_sampling_are_what_score_computes(qwen):
    _, engine = qwen
    d = engine.sampling_defaults

    async def go():
        prompt = engine.render([{"role": "user", "content": "How do I keep basil fresh?"}])
        gen = await engine.generate(prompt, SamplingParams(max_tokens=24, temperature=d.temperature, top_p=d.top_p,
                                                           top_k=d.top_k, seed=1)).final()
        return gen, await engine.score(prompt, gen.token_ids, temperature=d.temperature, top_k=d.top_k, top_p=d.top_p)

    gen, scored = asyncio.run(go())
    assert len(gen.token_ids) == 24 and max(abs(a - b) for a, b in zip(gen.logprobs, scored)) <= 1e-3
    assert gen.text.strip() and all(ord(c) < 0x2E80 for c in gen.text)  # English, no drift into Chinese


def test_given_a_tool_it_calls_it(qwen):
    _, engine = qwen
    d = engine.sampling_defaults
    tasks = ["What is 27 * 52?", "Compute 1234 + 4321.", "What is 17 squared?", "Divide 144 by 12."]

    async def go():
        prompts = [engine.render([{"role": "user", "content": t}], TOOLS) for t in tasks]
        return await asyncio.gather(*[engine.generate(p, SamplingParams(
            max_tokens=48, temperature=d.temperature, top_p=d.top_p, top_k=d.top_k, seed=i)).final()
            for i, p in enumerate(prompts)])

    gens = asyncio.run(go())
    calls = [engine.parse(g.content, TOOLS).tool_calls for g in gens]
    named = [c for c in calls if c and c[0].name == "calculator" and "expression" in json.loads(c[0].arguments)]
    assert len(named) >= 3, [g.text for g in gens]
