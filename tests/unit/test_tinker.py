"""`trainer.backend` / `engine.backend = "tinker"` against an in-process fake of the service's
clients backed by the tiny model (`tests/tinker_fake.py`; no network): the datums carry the local
trainer's tokens, logprobs and advantages; one step moves the service's LoRA as the local trainer
moves its own; a failing service loses nothing; the engine serves the published samplers and
keeps the previous one when a new one does not load."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from clawr1.core.config import load_config
from clawr1.core.types import AdapterError, EngineFailure, SamplingParams
from clawr1.datapool import SQLitePool
from clawr1.engine import adapters
from clawr1.engine.tinker import TinkerEngine
from clawr1.trainer.batch import TrainSample, load_samples, prepare, rl_advantages
from clawr1.trainer.loop import Trainer
from clawr1.trainer.policy import ADAPTER, pack
from clawr1.trainer.tinker import TinkerTrainer
from tests.tinker_fake import FakeService
from tests.unit.test_trainer import config_for, fill

pytest.importorskip("tinker")

TRAIN = ('trainer.method="combine"', "trainer.batch_size=6", "trainer.min_samples=0", "trainer.kl_coef=0")
TINKER = ('trainer.backend="tinker"', 'engine.backend="tinker"', 'tinker.base_model="tiny"')


def test_datums_carry_the_local_trainers_tokens_logprobs_and_advantages(tiny_model_dir, tmp_path, generations):
    config = config_for(tiny_model_dir, tmp_path, *TRAIN, "trainer.kl_coef=0.1", *TINKER)
    with SQLitePool(tmp_path, config.pool) as pool:
        fill(pool, generations[:6])  # rewards +1/-1, a hint every third sample
        remote = TinkerTrainer(config, pool, service=FakeService(tiny_model_dir, config.trainer))
        # Behaviour logprobs 0.3 below the base's, as from a policy that has drifted: the KL penalty shows.
        samples = [TrainSample(replace(s.step, logprobs=[x - 0.3 for x in s.step.logprobs]), s.reward, s.weight,
                               s.hint, s.lease_id) for s in load_samples(pool, pool.lease(6, current_version=0))]
        datums, metrics = remote.datums(samples)
        local = Trainer(config_for(tiny_model_dir, tmp_path / "local", *TRAIN), pool, resume=False)
        rl, _ = rl_advantages(samples, local.tc, 0.0)
        m = prepare(local.policy, samples, local.tc, rl)
    assert len(datums) == 6 and metrics["tokens"] == float(m.mask.sum()) > 0
    k = m.mask.shape[1]
    kl_seen = False
    for i, (datum, sample) in enumerate(zip(datums, samples, strict=True)):
        step, n, pad = sample.step, len(sample.step.token_ids), len(sample.step.prompt_ids) - 1
        assert datum.model_input.to_ints() == (step.prompt_ids + step.token_ids)[:-1]
        assert datum.loss_fn_inputs["target_tokens"].tolist() == (step.prompt_ids + step.token_ids)[1:]
        assert datum.loss_fn_inputs["logprobs"].tolist() == pytest.approx([0.0] * pad + step.logprobs, abs=1e-6)
        sent = torch.tensor(datum.loss_fn_inputs["advantages"].tolist())
        assert torch.all(sent[:pad] == 0)
        want = (m.advantage * m.mask)[i, k - n:] / metrics["tokens"]
        # the KL to the base enters as -kl_coef * (behaviour - base) per token (k1), divided the same way
        with local.policy.adapter_off():
            base = local.policy.logprobs(pack([step.prompt_ids], [step.token_ids], [1.0], local.policy.pad_id))[0]
        shaping = -0.1 * (torch.tensor(step.logprobs) - base) / metrics["tokens"] * m.mask[i, k - n:]
        kl_seen |= bool(shaping.abs().max() > 1e-6)
        assert torch.allclose(sent[pad:], (want + shaping).float(), atol=1e-5), i
    assert kl_seen


@pytest.mark.parametrize("epochs", [1, 2])
def test_one_step_on_the_service_moves_its_lora_as_the_local_trainer_moves_its_own(tiny_model_dir, tmp_path,
                                                                                     generations, epochs):
    """`trainer.epochs = 2` too: two passes on the service, each recomputing the clipped ratios."""
    one, two = tmp_path / "local", tmp_path / "tinker"
    train = (*TRAIN, f"trainer.epochs={epochs}")
    for data_dir in (one, two):
        with SQLitePool(data_dir, config_for(tiny_model_dir, data_dir).pool) as pool:
            fill(pool, generations[:6])
    with SQLitePool(one) as pool:
        local = Trainer(config_for(tiny_model_dir, one, *train), pool)
        before = {n: p.detach().clone() for n, p in local.policy.named_trainable().items()}
        assert local.run_once()["version"] == 1
        want = {n: p.detach().clone() for n, p in local.policy.named_trainable().items()}
    config = config_for(tiny_model_dir, two, *train, *TINKER)
    service = FakeService(tiny_model_dir, config.trainer)
    with SQLitePool(two) as pool:
        metrics = TinkerTrainer(config, pool, service=service).run_once()
        assert metrics["version"] == 1 and pool.stats()["consumed"] == 6
    got = service.training.weights()
    assert set(got) == set(want)
    assert any(not torch.equal(want[n], before[n]) for n in want)  # it trained
    # A second Adam step divides by the first's tiny moments, so float noise grows (still 1% of lr).
    tolerance = 1e-5 if epochs == 1 else 1e-4
    for name, tensor in want.items():
        assert torch.allclose(got[name], tensor, atol=tolerance), (name, float((got[name] - tensor).abs().max()))
    passes = [c for c in service.calls if c[0] == "forward_backward"]
    assert len(passes) == epochs and len([c for c in service.calls if c[0] == "optim_step"]) == epochs
    (_, (datums, loss, bounds)) = passes[0]
    assert len(datums) == 6
    assert loss == "ppo" and bounds == {"clip_low_threshold": pytest.approx(0.8), "clip_high_threshold": 1.28}
    _, adam = next(c for c in service.calls if c[0] == "optim_step")
    # config_for's lr 0.01, its first step a quarter of it (the default warmup of 4 steps)
    assert (adam.learning_rate, adam.beta2, adam.eps, adam.grad_clip_norm) == (0.0025, 0.999, 1e-8, 1.0)
    version = adapters.version_dir(two / "adapters", ADAPTER, 1)
    assert (version / adapters.MARKER).is_file() and "sampler" in (version / adapters.REMOTE).read_text()


def test_a_failing_service_loses_nothing_and_a_restart_trains_the_samples_once(tiny_model_dir, tmp_path,
                                                                                generations, pool_later):
    config = config_for(tiny_model_dir, tmp_path, *TRAIN, *TINKER, "pool.lease_seconds=1")
    service = FakeService(tiny_model_dir, config.trainer)
    with SQLitePool(tmp_path, config.pool) as pool:
        fill(pool, generations[:6])
        trainer = TinkerTrainer(config, pool, service=service)
        service.fail.add("save_state")  # the step ran on the service; saving it failed
        with pytest.raises(RuntimeError, match="service unavailable"):
            trainer.run_once()
        assert pool.stats().get("consumed", 0) == 0 and adapters.latest(tmp_path / "adapters", ADAPTER) is None
        service.fail.clear()
        restarted = TinkerTrainer(config, pool, service=service)  # no checkpoint: a fresh LoRA
        pool_later(1.2)  # the dead trainer's lease expires
        assert restarted.run_once()["version"] == 1
        assert pool.stats()["consumed"] == 6
        again = TinkerTrainer(config, pool, service=service)  # resumes from the saved state
        assert (again.version, again.step_count) == (1, 1) and again.state_path == restarted.state_path


def test_a_crash_between_publishing_and_checkpointing_resumes_past_the_published_version(tiny_model_dir, tmp_path,
                                                                                          generations, pool_later):
    """v1 is published, then the trainer dies before its checkpoint: the lease was not acknowledged,
    so its samples come back, and the restarted trainer publishes them as v2 (not v1 again)."""
    config = config_for(tiny_model_dir, tmp_path, *TRAIN, *TINKER, "pool.lease_seconds=1")
    service = FakeService(tiny_model_dir, config.trainer)
    with SQLitePool(tmp_path, config.pool) as pool:
        fill(pool, generations[:6])
        trainer = TinkerTrainer(config, pool, service=service)

        def die(lease_ids: list[str]) -> None:
            raise RuntimeError("killed before the checkpoint")

        trainer._write_state = die
        with pytest.raises(RuntimeError, match="killed"):
            trainer.run_once()
        assert adapters.latest(tmp_path / "adapters", ADAPTER)[0] == 1 and pool.stats().get("consumed", 0) == 0
        pool_later(1.2)  # the dead trainer's lease expires
        restarted = TinkerTrainer(config, pool, service=service)
        assert restarted.run_once()["version"] == 2 and pool.stats()["consumed"] == 6


def test_an_admin_rollback_sends_the_service_back_to_that_versions_state(tiny_model_dir, tmp_path, generations):
    config = config_for(tiny_model_dir, tmp_path, *TRAIN, "trainer.batch_size=3", *TINKER)
    service = FakeService(tiny_model_dir, config.trainer)
    with SQLitePool(tmp_path, config.pool) as pool:
        fill(pool, generations[:9])
        trainer = TinkerTrainer(config, pool, service=service)
        trainer.run_once()
        at_v1 = service.training.weights()
        trainer.run_once()
        assert any(not torch.equal(at_v1[n], t) for n, t in service.training.weights().items())
        adapters.set_control(tmp_path / "adapters", ADAPTER, rollback={"to": 1, "id": "r1"})
        trainer.apply_rollback()
        assert all(torch.equal(at_v1[n], t) for n, t in service.training.weights().items())  # v1's state again
        assert trainer.run_once()["version"] == 3  # trained on from there
        assert (trainer.promoted, trainer.weights_of, trainer.rollbacks) == (1, 3, ["r1"])
        again = TinkerTrainer(config, pool, service=service)  # the rollback is applied once, across restarts
        again.apply_rollback()
        assert again.rollbacks == ["r1"] and again.version == 3


def test_a_failing_sampler_fails_the_request_and_never_hangs_it(tiny_model_dir, tmp_path):
    config = config_for(tiny_model_dir, tmp_path, *TRAIN, *TINKER)
    service = FakeService(tiny_model_dir, config.trainer)

    async def go() -> None:
        engine = TinkerEngine(tiny_model_dir, config, service=service)
        service.fail.add("sample")
        stream = engine.generate(engine.render([{"role": "user", "content": "hi"}]), SamplingParams(max_tokens=4))
        with pytest.raises(EngineFailure, match="the service failed sampling"):
            await asyncio.wait_for(stream.final(), 30)
        await engine.close()

    asyncio.run(go())


def test_the_engine_serves_published_samplers_and_keeps_the_previous_one(tiny_model_dir, tmp_path, generations):
    config = config_for(tiny_model_dir, tmp_path, *TRAIN, *TINKER)
    service = FakeService(tiny_model_dir, config.trainer)
    with SQLitePool(tmp_path, config.pool) as pool:
        fill(pool, generations[:6])
        TinkerTrainer(config, pool, service=service).run_once()

    async def go() -> None:
        engine = TinkerEngine(tiny_model_dir, config, service=service)
        prompt = engine.render([{"role": "user", "content": "Tell me something."}])
        gen = await engine.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=3)).final()
        assert gen.token_ids and len(gen.logprobs) == len(gen.token_ids) and gen.finish_reason in ("stop", "length")
        scored = await engine.score(prompt, gen.token_ids)  # the base sampler's own logprobs: token-faithful
        assert scored == pytest.approx(gen.logprobs, abs=1e-5)
        assert await engine.load_adapter(ADAPTER, adapters.version_dir(tmp_path / "adapters", ADAPTER, 1)) == 1
        tuned = await engine.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=3), ADAPTER).final()
        assert tuned.version == 1
        assert await engine.score(prompt, tuned.token_ids, ADAPTER) != pytest.approx(
            await engine.score(prompt, tuned.token_ids), abs=1e-6)  # the trained sampler, not the base
        service.fail.add("create_sampling_client")
        v2 = adapters.publish_remote(tmp_path / "adapters", ADAPTER, 2, {"sampler_path": "tinker://fake/x/sampler"})
        with pytest.raises(AdapterError, match="did not give a sampler"):
            await engine.load_adapter(ADAPTER, v2)
        assert engine.adapters() == {ADAPTER: 1}
        again = await engine.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=3), ADAPTER).final()
        assert again.version == 1 and again.token_ids == tuned.token_ids
        await engine.close()

    asyncio.run(go())


def test_a_tinker_backend_is_configured_whole():
    with pytest.raises(ValueError, match="tinker.base_model"):
        load_config(None, ['trainer.backend="tinker"', 'engine.backend="tinker"'])
    with pytest.raises(ValueError, match="set both or neither"):
        load_config(None, ['trainer.backend="tinker"', 'tinker.base_model="m"'])
    with pytest.raises(ValueError, match="set both or neither"):
        load_config(None, ['engine.backend="tinker"', 'tinker.base_model="m"'])
    with pytest.raises(ValueError, match="train locally"):
        load_config(None, [*TINKER, 'trainer.opd_estimator="full"'])
