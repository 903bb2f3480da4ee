"""Two trainer steps on the real SmolLM2: every LoRA matrix moves, and on the same batch the
positively rewarded replies become more likely and the negative ones less."""

from __future__ import annotations

import asyncio

import torch

from clawr1.core.config import load_config
from clawr1.core.records import Step
from clawr1.core.types import SamplingParams
from clawr1.datapool import SQLitePool
from clawr1.trainer.batch import TrainSample
from clawr1.trainer.loop import Trainer
from tests.conftest import run

QUESTIONS = ["Name a fruit.", "What is 2 + 2?", "Say hello.", "Name a colour.",
             "What is the capital of Italy?", "Name an animal.", "Give me a number.", "Name a planet."]


def test_two_rl_steps_move_every_lora_matrix_the_right_way(real_engine, real_data_dir, tmp_path):
    async def sample():
        out = []
        for i, q in enumerate(QUESTIONS):
            messages = [{"role": "user", "content": q}]
            gen = await real_engine.generate(real_engine.render(messages),
                                             SamplingParams(max_tokens=16, temperature=1.0, seed=i)).final()
            out.append(Step(step_id=f"r{i}", tenant="default", session_id=f"s{i}", prompt_id=f"s{i}", turn_index=0,
                            turn_type="main", messages=messages, tools=None, prompt_ids=gen.prompt_ids,
                            token_ids=gen.token_ids, logprobs=gen.logprobs, text=gen.text, policy_version=0,
                            adapter=None, finish_reason=gen.finish_reason, temperature=gen.temperature))
        return out

    steps = run(sample())
    config = load_config(None, [f'data_dir="{real_data_dir}"', 'trainer.method="rl"', "trainer.micro_batch=4",
                                "trainer.lr=0.001", "trainer.threads=2"])
    with SQLitePool(tmp_path, config.pool) as pool:
        trainer = Trainer(config, pool, resume=False)
        samples = [TrainSample(step, 1.0 if i % 2 == 0 else -1.0) for i, step in enumerate(steps)]
        before = {n: p.detach().clone() for n, p in trainer.policy.named_trainable().items()}
        old = [trainer.sequence_logprob(s.prompt_ids, s.token_ids, s.temperature) for s in steps]
        first = trainer.train_step(samples)
        trainer.train_step(samples)
        new = [trainer.sequence_logprob(s.prompt_ids, s.token_ids, s.temperature) for s in steps]
    moved = [n for n, p in trainer.policy.named_trainable().items() if not torch.equal(p, before[n])]
    assert len(moved) == len(before) > 100
    assert abs(first["ratio"] - 1.0) < 1e-3  # the first step is on-policy: trainer == engine logprobs
    for i, (a, b) in enumerate(zip(old, new)):
        assert (b > a) if i % 2 == 0 else (b < a), f"reply {i}: {a:.3f} -> {b:.3f}"
    assert asyncio.iscoroutinefunction(real_engine.score)
