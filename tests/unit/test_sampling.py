"""Sampling as the model's authors recommend (temperature, top_k, top_p from its generation config,
as vLLM applies them), with the recorded logprobs exactly those of the distribution each token was
drawn from: the engine's sample, its `score`, the trainer's policy (the importance ratio) and its
fused head's gradient agree; a request that names nothing gets the model's settings, config
overrides them, and the step records them."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch

from clawr1.core.config import EngineConfig, load_config
from clawr1.core.types import SamplingParams
from clawr1.datapool import SQLitePool
from clawr1.engine.local import LocalEngine
from clawr1.engine.sampling import processed_logprobs, sample, truncated
from clawr1.trainer import head
from clawr1.trainer.loop import Trainer
from clawr1.trainer.policy import pack
from tests.conftest import run
from tests.gateway_helpers import live_gateway, steps_of

CUTS = [(5, 1.0), (0, 0.6), (8, 0.7)]


def test_the_cut_keeps_the_top_k_then_the_nucleus_of_what_is_left():
    z = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]))
    keep = lambda k, p: torch.isfinite(truncated(z, k, p))[0].tolist()  # noqa: E731
    assert keep(3, 1.0) == [True, True, True, False, False]
    assert keep(0, 0.7) == [True, True, False, False, False]  # 0.4 + 0.3 reach 0.7
    assert keep(0, 0.71) == [True, True, True, False, False]
    assert keep(2, 0.6) == [True, True, False, False, False]  # over the top 2 renormalised: 0.57 then 0.43
    assert keep(2, 0.5) == [True, False, False, False, False]
    assert keep(0, 0.01) == [True, False, False, False, False]  # the most likely is always kept
    assert truncated(z, 0, 1.0) is z


def test_every_draw_is_in_the_kept_set_and_its_logprob_is_the_renormalised_one():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3
    for k, p in CUTS:
        expected = processed_logprobs(logits[None] / 0.7, [k], [p])[0]
        gen = torch.Generator().manual_seed(1)
        for _ in range(200):
            token, logprob = sample(logits, 0.7, k, p, gen)
            assert torch.isfinite(expected[token]) and logprob == pytest.approx(float(expected[token]), abs=1e-6)
        assert torch.logsumexp(expected, 0) == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("k,p", CUTS)
def test_the_engine_records_what_score_and_the_trainer_compute(engine, tiny_model_dir, tmp_path, k, p):
    ids = engine.render([{"role": "user", "content": "Tell me a story."}])

    async def go():
        gen = await engine.generate(ids, SamplingParams(max_tokens=24, temperature=0.8, top_k=k, top_p=p,
                                                        seed=3)).final()
        return (gen, await engine.score(ids, gen.token_ids, temperature=0.8, top_k=k, top_p=p),
                await engine.score(ids, gen.token_ids, temperature=0.8))

    gen, scored, uncut = run(go())
    assert (gen.top_k, gen.top_p) == (k, p)
    assert max(abs(a - b) for a, b in zip(gen.logprobs, scored)) <= 1e-3
    assert sum(gen.logprobs) > sum(uncut) + 0.5  # the cut is folded in: renormalised over fewer tokens
    config = load_config(None, [f'data_dir="{tmp_path}"', f'engine.model="{tiny_model_dir}"'])
    with SQLitePool(tmp_path, config.pool) as pool:
        policy = Trainer(config, pool).policy
        mine = policy.logprobs(pack([ids], [gen.token_ids], [0.8], policy.pad_id, [(k, p)]))[0]
    assert mine.tolist() == pytest.approx(gen.logprobs, abs=1e-3)  # the importance ratio is 1 at v0


@pytest.mark.parametrize("terms", [("logp",), ("logp", "entropy", "kl")])
def test_the_fused_head_under_a_cut_has_the_gradients_of_the_naive_computation(monkeypatch, terms):
    monkeypatch.setattr(head, "CHUNK_ELEMENTS", 3 * 301)
    gen = torch.Generator().manual_seed(5)
    n, hidden_size, vocab = 9, 16, 301
    hidden = torch.randn(n, hidden_size, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=gen).requires_grad_()
    reference = torch.randn(n, hidden_size, generator=gen)
    inv_t = 1 / torch.linspace(0.5, 1.2, n)
    cut = ([5, 5, 5, 0, 0, 0, 20, 20, 20], [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.9, 0.9, 0.9])
    targets = torch.randint(0, vocab, (n,), generator=gen)  # many outside the kept set: kept for them
    coefficients = {term: torch.randn(n, generator=gen) for term in terms}

    def naive(h, w):
        z = h @ w.T * inv_t[:, None]
        logp = torch.log_softmax(z, -1)
        p = logp.exp()
        zr = reference @ w.detach().T * inv_t[:, None]
        return {"logp": processed_logprobs(z, *cut, keep=targets).gather(-1, targets[:, None]).squeeze(-1),
                "entropy": -(p * logp).sum(-1), "kl": (p * (logp - torch.log_softmax(zr, -1))).sum(-1),
                "ref_logp": processed_logprobs(zr, *cut, keep=targets).gather(-1, targets[:, None]).squeeze(-1)}

    def fused(h, w):
        outs = head.head_stats(h, w, targets, inv_t, reference, None, cut=cut)
        return {"logp": outs[0], "entropy": outs[1], "kl": outs[2], "ref_logp": outs[5]}

    grads = []
    for fn in (naive, fused):
        values = fn(hidden, weight)
        grads.append(torch.autograd.grad(sum((values[t] * coefficients[t]).sum() for t in terms), (hidden, weight)))
        for term, value in values.items():
            assert torch.isfinite(value).all() and torch.allclose(value, naive(hidden, weight)[term], atol=1e-5), term
    for got, expected in zip(grads[1], grads[0], strict=True):
        assert float((got - expected).norm() / expected.norm()) < 1e-5, terms
    uncut, cut_logp = head.head_stats(hidden, weight, targets, inv_t)[0], fused(hidden, weight)["logp"]
    assert (cut_logp >= uncut - 1e-6).all() and (cut_logp > uncut + 0.1).sum() >= 3  # renormalised over fewer


@pytest.fixture(scope="module")
def advised_model(tiny_model_dir, tmp_path_factory):
    """The tiny model with its authors' advice in generation_config.json, as Qwen2.5 ships it."""
    path = tmp_path_factory.mktemp("advised") / "model"
    shutil.copytree(tiny_model_dir, path)
    advice = {**json.loads((path / "generation_config.json").read_text()), "temperature": 0.6, "top_p": 0.8,
              "top_k": 12, "do_sample": True}
    (path / "generation_config.json").write_text(json.dumps(advice))
    engine = LocalEngine.load(path, EngineConfig(threads=1))
    yield engine
    run(engine.close())


def test_a_request_naming_nothing_gets_the_models_sampling_and_config_overrides_it(advised_model, tmp_path):
    ask = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with live_gateway(advised_model, tmp_path / "a") as (base, pool):
        httpx.post(f"{base}/v1/chat/completions", json=ask).raise_for_status()
        httpx.post(f"{base}/v1/chat/completions", json={**ask, "temperature": 1.1, "top_k": 0}).raise_for_status()
        plain, named = sorted(steps_of(pool, 2), key=lambda s: s.temperature)
    assert (plain.temperature, plain.top_p, plain.top_k) == (0.6, 0.8, 12)
    assert (named.temperature, named.top_p, named.top_k) == (1.1, 0.8, 0)  # each setting its own default
    with live_gateway(advised_model, tmp_path / "b", "engine.temperature=0.3", "engine.top_k=0") as (base, pool):
        httpx.post(f"{base}/v1/chat/completions", json=ask).raise_for_status()
        [step] = steps_of(pool, 1)
    assert (step.temperature, step.top_p, step.top_k) == (0.3, 0.8, 0)
    score = run(advised_model.score(step.prompt_ids, step.token_ids, temperature=0.3, top_p=0.8))
    assert score == pytest.approx(step.logprobs, abs=1e-3)  # stored, read back: still the sampled distribution
