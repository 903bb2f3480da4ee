"""Can it learn at all: a fixed, deterministic reward through the whole loop (the gateway serves and
records, a judge stand-in reads each reply's token from the pool and posts its reward as feedback,
the trainer trains on the pool and publishes, the gateway swaps the version in) raises the
preferred answer's share on held-out prompts within a few versions; the same loop with the rewards
flipped lowers it. Cutting any link (no recording, no reward, no training, no swap) leaves the
held-out share where the base model has it, and the first test fails.

The answer a reply gives is its first token's class, id mod 3 (three answers, each a third of the
vocabulary): the tiny random model has no words, but it has this choice, and a third of its mass
on each answer to begin with."""

from __future__ import annotations

import httpx
import pytest

from clawr1.core.config import load_config
from clawr1.trainer.loop import Trainer
from tests.gateway_helpers import live_gateway, wait_for

TRAIN = [f"Choose A, B or C. Question {i}." for i in range(32)]
HELD_OUT = [f"Pick an answer, A, B or C: case {i}?" for i in range(48)]
VERSIONS = 6
OVERRIDES = ["guard.enabled=false", "gateway.adapter_poll_s=0.05", "trainer.batch_size=32", "trainer.max_wait_s=0",
             'trainer.method="rl"', "trainer.lr=0.05", "trainer.kl_coef=0", "trainer.epochs=2"]


def answer(pool, completion_id: str) -> int:
    [step] = pool.get_steps([completion_id + "-0"])
    return step.token_ids[0] % 3


def ask(base: str, question: str, seed: int, side: bool = False) -> str:
    response = httpx.post(f"{base}/v1/chat/completions", timeout=60, headers={"X-Turn-Type": "side"} if side else {},
                          json={"model": "m", "max_tokens": 1, "temperature": 1.0, "seed": seed,
                                "messages": [{"role": "user", "content": question}]})
    response.raise_for_status()
    return response.json()["id"]


def held_out_share(base: str, pool) -> float:
    ids = [ask(base, q, 10_000 + i, side=True) for i, q in enumerate(HELD_OUT)]
    wait_for(lambda: not pool.pending_writes())
    return sum(answer(pool, i) == 0 for i in ids) / len(ids)


def learn(engine, model_dir, data_dir, sign: float) -> list[float]:
    """The held-out share of answer 0 at the base and after each version; rewards +sign for answer 0."""
    overrides = [f'engine.model="{model_dir}"', *OVERRIDES]
    with live_gateway(engine, data_dir, *overrides) as (base, pool):
        trainer = Trainer(load_config(None, [f'data_dir="{data_dir}"', *overrides]), pool)
        shares = [held_out_share(base, pool)]
        for version in range(1, VERSIONS + 1):
            for i, question in enumerate(TRAIN):
                completion = ask(base, question, version * 1000 + i)
                reward = sign if answer(pool, completion) == 0 else -sign  # the judge stand-in
                httpx.post(f"{base}/v1/feedback", json={"completion_id": completion, "reward": reward},
                           timeout=30).raise_for_status()
            assert trainer.run_once()["version"] == version
            wait_for(lambda v=version: engine.adapters().get("policy") == v, timeout=30, what=f"v{version} served")
            shares.append(held_out_share(base, pool))
    return shares


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["rewarded", "flipped"])
def test_a_fixed_reward_moves_the_held_out_answers_through_the_whole_loop(fresh_engine, tiny_model_dir, tmp_path,
                                                                          sign):
    shares = learn(fresh_engine, tiny_model_dir, tmp_path, sign)
    # Seen (2026-12-07): rewarded 0.21 -> 0.27, 0.29, 0.85, 1.00, 1.00, 1.00; flipped 0.21 -> 0.25, 0.40,
    # 0.29, 0.00, 0.04, 0.00 (48 held-out answers a version: about +-0.07 of noise).
    if sign > 0:
        assert shares[0] < 0.5 and shares[-1] >= 0.7, shares  # from about a third to most answers
    else:
        assert max(shares) < 0.5 and shares[-1] <= shares[0], shares  # never near the threshold, and lower
