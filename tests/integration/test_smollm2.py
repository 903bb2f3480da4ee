"""Behaviour on the real embedded model: conversion cache, answers, token faithfulness, the CLI."""

import asyncio
import os
import subprocess
import sys

from clawr1.core.types import SamplingParams
from clawr1.engine.models import MARKER, list_models, resolve_model
from tests.conftest import run


def test_conversion_is_cached_and_keeps_the_chat_template(real_data_dir):
    path = resolve_model("smollm2-135m-instruct", real_data_dir)
    marker = (path / MARKER).stat().st_mtime_ns
    assert resolve_model("smollm2-135m-instruct", real_data_dir) == path
    assert (path / MARKER).stat().st_mtime_ns == marker  # not converted again
    assert (path / "model.safetensors").is_file() and "im_start" in (path / "chat_template.jinja").read_text()
    assert not list((path.parent).glob("*.tmp"))
    assert list_models(real_data_dir)[0].status.startswith("ready")


def test_answers_a_simple_question(real_engine):
    ids = real_engine.render([{"role": "user", "content": "What is the capital of France?"}])

    async def go():
        return await real_engine.generate(ids, SamplingParams(max_tokens=24, temperature=0)).final()

    gen = run(go())
    assert "Paris" in gen.text
    assert gen.finish_reason == "stop" and gen.token_ids[-1] in real_engine.eos_ids


def test_token_faithful_capture_in_a_batch(real_engine):
    questions = ["Name a fruit.", "Say hello in French.", "What is 2 + 2?", "Describe the sea in one sentence."]

    async def go():
        prompts = [real_engine.render([{"role": "user", "content": q}]) for q in questions]
        gens = await asyncio.gather(*[
            real_engine.generate(p, SamplingParams(max_tokens=24, temperature=0.8, seed=i)).final()
            for i, p in enumerate(prompts)])
        scores = [await real_engine.score(p, g.token_ids, temperature=0.8) for p, g in zip(prompts, gens)]
        return gens, scores

    gens, scores = run(go())
    for gen, scored in zip(gens, scores):
        assert max(abs(a - b) for a, b in zip(gen.logprobs, scored)) <= 1e-3
        assert real_engine.tokenizer.decode(gen.token_ids, skip_special_tokens=True) == gen.text


def test_cli_chat_streams_an_answer(real_data_dir):
    env = {**os.environ, "CLAWR1_DATA_DIR": str(real_data_dir)}
    out = subprocess.run([sys.executable, "-m", "clawr1.cli.main", "chat", "What is the capital of France?",
                          "--max-tokens", "24", "--threads", "1", "--temperature", "0"], env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "policy version v0" in out.stderr
