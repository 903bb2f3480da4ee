"""The trainer's guards against drift on the tiny model: the full-vocabulary KL to the base holds the
policy near it, the entropy band moves the entropy, the reward baseline and the EMA teacher keep
their state, the drift metrics are logged every step, and gradients accumulate across leases into
one version that steps exactly like one batch."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from clawr1.core.config import TrainerConfig
from clawr1.datapool import SQLitePool
from clawr1.trainer import checkpoint
from clawr1.trainer.accumulate import Accumulated, scheduled_lr, version_due
from clawr1.trainer.batch import TrainSample, prepare
from clawr1.trainer.history import DRIFT_FIELDS, read_metrics
from clawr1.trainer.loop import Trainer
from clawr1.trainer.losses import ema_update, masked_mean, vocab_entropy, vocab_kl
from tests.unit.test_trainer import add, config_for, fill, step_of

DRIFT_KEYS = {*DRIFT_FIELDS, "lease_ids", "leases", "staleness", "accumulated_s"}


def samples_of(generations, rewards) -> list[TrainSample]:
    return [TrainSample(step_of(i, *generations[i]), r) for i, r in enumerate(rewards)]


@torch.no_grad()
def drift(trainer: Trainer, samples: list[TrainSample]) -> tuple[float, float]:
    """(KL(policy || base), policy entropy), per reply token over the whole vocabulary."""
    m = prepare(trainer.policy, samples, trainer.tc, torch.ones(len(samples)))
    policy = trainer.policy.distributions(m.rows)
    with trainer.policy.adapter_off():
        base = trainer.policy.distributions(m.rows)
    return (float(masked_mean(vocab_kl(policy, base), m.rows.mask)),
            float(masked_mean(vocab_entropy(policy), m.rows.mask)))


def trained(tiny_model_dir, data_dir, samples, steps, *extra) -> Trainer:
    config = config_for(tiny_model_dir, data_dir, 'trainer.method="rl"', "trainer.micro_batch=4", *extra)
    with SQLitePool(data_dir, config.pool) as pool:
        trainer = Trainer(config, pool, resume=False)
        for _ in range(steps):
            trainer.train_step(samples)
    return trainer


def test_drift_metrics_are_logged_every_step(tiny_model_dir, tmp_path, generations):
    config = config_for(tiny_model_dir, tmp_path, "trainer.warmup_steps=2")
    with SQLitePool(tmp_path, config.pool) as pool:
        fill(pool, generations)
        trainer = Trainer(config, pool)
        first, second = trainer.run_once(), trainer.run_once()
    logged = read_metrics(tmp_path)
    assert len(logged) == 2 and all(DRIFT_KEYS <= row.keys() for row in logged)
    # Before the first update the LoRA is zero: the policy is the base, and it is the sampler.
    assert first["kl_base"] == pytest.approx(0.0, abs=1e-6) and first["kl_sampler"] == pytest.approx(0.0, abs=1e-4)
    # The second batch was sampled by v0 too, and is scored by v1: both have moved off.
    assert second["kl_base"] > 1e-6 and second["kl_sampler"] > 1e-6
    assert 0 < first["entropy"] < 10.81  # below ln(49152), the uniform distribution's
    for row in (first, second):
        fractions = row["adv_pos_frac"] + row["adv_neg_frac"] + row["adv_zero_frac"]
        assert fractions == pytest.approx(1.0) and row["adv_pos_frac"] > 0 and row["adv_neg_frac"] > 0
    assert (first["lr"], second["lr"]) == pytest.approx((0.005, 0.01))  # warmup over 2 steps, then lr
    assert first["leases"] == 1 and first["lease_ids"] == [first["lease_id"]]


def test_a_large_full_kl_coefficient_holds_the_policy_near_the_base(tiny_model_dir, tmp_path, generations):
    samples = samples_of(generations, [-1.0, -1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0])  # mostly -1
    raw = ('trainer.baseline="none"', "trainer.negative_weight=1")  # the raw -1s: the case that runs away
    free = trained(tiny_model_dir, tmp_path / "free", samples, 4, "trainer.kl_coef=0", *raw)
    held = trained(tiny_model_dir, tmp_path / "held", samples, 4, "trainer.kl_coef=10", 'trainer.kl_estimator="full"',
                   *raw)
    k3 = trained(tiny_model_dir, tmp_path / "k3", samples, 4, "trainer.kl_coef=10", 'trainer.kl_estimator="k3"', *raw)
    (kl_free, _), (kl_held, _), (kl_k3, _) = drift(free, samples), drift(held, samples), drift(k3, samples)
    # Measured: 1.23 unpenalised, 0.78 with k3 on the sampled tokens, 0.21 with the full KL (nats per token).
    assert kl_free > 0.05 and kl_held < kl_free / 3 and kl_held < kl_k3 < kl_free, (kl_free, kl_held, kl_k3)
    # Held, it still learns: every LoRA B moved off zero.
    assert all(not torch.equal(p, torch.zeros_like(p)) for n, p in held.policy.named_trainable().items() if "lora_B" in n)


def test_without_a_penalty_the_kl_to_the_base_is_measured_every_nth_step_only(tiny_model_dir, tmp_path, generations,
                                                                               monkeypatch):
    samples = samples_of(generations, [1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    base_passes = []

    def run(name, every):
        config = config_for(tiny_model_dir, tmp_path / name, 'trainer.method="rl"', "trainer.micro_batch=4",
                            "trainer.kl_coef=0", f"trainer.kl_base_every={every}")
        with SQLitePool(tmp_path / name, config.pool) as pool:
            trainer = Trainer(config, pool, resume=False)
            off = trainer.policy.adapter_off
            counted = []

            def counting_off():
                counted.append(1)
                return off()
            monkeypatch.setattr(trainer.policy, "adapter_off", counting_off)
            metrics = [trainer.train_step(samples) for _ in range(3)]
            base_passes.append(len(counted))
            return trainer, metrics

    every, every_metrics = run("every", 1)
    third, third_metrics = run("third", 3)
    never, never_metrics = run("never", 0)
    # Measured on steps 0 of 3 only (and every step at 1); never at 0. Two micro-batches a step.
    assert ["kl_base" in m for m in every_metrics] == [True, True, True]
    assert ["kl_base" in m for m in third_metrics] == [True, False, False]
    assert not any("kl_base" in m for m in never_metrics)
    assert base_passes == [6, 2, 0]
    assert third_metrics[0]["kl_base"] == pytest.approx(every_metrics[0]["kl_base"], abs=1e-7)
    assert every_metrics[2]["kl_base"] > 1e-6  # the policy moved off the base: the updates below are not zero
    # Only a metric at kl_coef = 0: the updates are the same whether it was measured or not.
    for name, param in every.policy.model.named_parameters():
        if param.requires_grad:
            assert torch.allclose(param, never.policy.model.get_parameter(name), atol=1e-6), name
            assert torch.allclose(param, third.policy.model.get_parameter(name), atol=1e-6), name


def test_the_k3_penalty_takes_the_bases_logprobs_from_the_one_base_forward(tiny_model_dir, tmp_path, generations,
                                                                            monkeypatch):
    """With `kl_estimator = "k3"` the base forward that measures `kl_base` also gives the base's
    logprobs of the sampled tokens: one base pass a micro-batch, not two, and the same penalty as
    k3 over a base forward of its own."""
    from clawr1.trainer.losses import kl_to_reference
    from tests.unit.test_trainer_device import moved

    samples = samples_of(generations, [1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    config = config_for(tiny_model_dir, tmp_path, 'trainer.method="rl"', "trainer.kl_coef=0.5",
                        'trainer.kl_estimator="k3"')
    with SQLitePool(tmp_path, config.pool) as pool:
        trainer = Trainer(config, pool, resume=False)
        moved(trainer)  # off the base, so the penalty is not zero
        policy = trainer.policy
        m = prepare(policy, samples, trainer.tc, torch.ones(len(samples)))
        with torch.no_grad():
            logp = policy.logprobs(m.rows)
            with policy.adapter_off():
                expected = float(kl_to_reference(logp, policy.logprobs(m.rows), m.mask))
        off, counted = policy.adapter_off, []

        def counting_off():
            counted.append(1)
            return off()

        monkeypatch.setattr(policy, "adapter_off", counting_off)
        _, metrics = trainer.loss(m)
    assert len(counted) == 1  # one base pass for the micro-batch: kl_base and k3's logprobs both
    assert metrics["kl"] > 1e-4 and metrics["kl"] == pytest.approx(expected, rel=1e-4)


def test_the_entropy_band_moves_the_entropy_toward_it(tiny_model_dir, tmp_path, generations):
    samples = samples_of(generations, [1.0, -1.0] * 4)
    _, start = drift(trained(tiny_model_dir, tmp_path / "start", samples, 0), samples)
    _, free = drift(trained(tiny_model_dir, tmp_path / "free", samples, 3), samples)
    _, capped = drift(trained(tiny_model_dir, tmp_path / "cap", samples, 3, "trainer.entropy_coef=5",
                              "trainer.entropy_max=0"), samples)
    _, floored = drift(trained(tiny_model_dir, tmp_path / "floor", samples, 3, "trainer.entropy_coef=5",
                               "trainer.entropy_min=20"), samples)
    assert capped < start - 0.1 and capped < free - 0.1, (start, free, capped)
    assert floored > start + 0.1 and floored > free + 0.1, (start, free, floored)


def test_the_reward_baseline_follows_the_online_rewards(tiny_model_dir, tmp_path, generations):
    config = config_for(tiny_model_dir, tmp_path, 'trainer.method="rl"', 'trainer.baseline="ema"',
                        "trainer.baseline_decay=0.5", "trainer.negative_weight=1")
    with SQLitePool(tmp_path, config.pool) as pool:
        trainer = Trainer(config, pool, resume=False)
        negatives = samples_of(generations, [-1.0] * 4)
        first = trainer.train_step(negatives)
        second = trainer.train_step(negatives)
    assert first["reward_baseline"] == pytest.approx(ema_update(0.0, torch.tensor([-1.0] * 4), 0.5))
    assert second["reward_baseline"] == trainer.reward_baseline == pytest.approx(-1 + 0.5 ** 8)
    # The first batch is judged against 0 (no rewards seen yet), the second against about -0.94.
    assert first["adv_mean"] == pytest.approx(-1.0) and second["adv_mean"] == pytest.approx(-0.5 ** 4, abs=1e-6)


def test_the_ema_teacher_averages_the_weights_and_swaps_in_without_copies(tiny_model_dir, tmp_path, generations):
    config = config_for(tiny_model_dir, tmp_path, 'trainer.teacher="ema"', "trainer.ema_decay=0.75")
    with SQLitePool(tmp_path, config.pool) as pool:
        fill(pool, generations)
        trainer = Trainer(config, pool)
        policy = trainer.policy
        w0 = {n: p.detach().clone() for n, p in policy.named_trainable().items()}
        metrics = trainer.run_once()
        assert metrics["hint_rate"] > 0  # the EMA teacher scored the hinted samples
    w1 = policy.named_trainable()
    state = policy.named_state()
    assert {f"ema.{n}" for n in w0} | set(w0) == set(state)
    for name, weight in w1.items():
        assert torch.allclose(state[f"ema.{name}"], 0.75 * w0[name] + 0.25 * weight.detach(), atol=1e-7)
    data = {n: p.data.data_ptr() for n, p in w1.items()}
    with policy.ema_weights():
        assert all(torch.equal(p, state[f"ema.{n}"]) for n, p in policy.named_trainable().items())
    after = policy.named_trainable()
    assert all(p.data.data_ptr() == data[n] for n, p in after.items())  # traded back, nothing copied


def test_gradients_accumulate_across_leases_into_one_version(tiny_model_dir, tmp_path, generations):
    # No reward baseline: it moves between leases, and the comparison below is one batch of the same six.
    config = config_for(tiny_model_dir, tmp_path / "a", 'trainer.method="rl"', "trainer.batch_size=6",
                        "trainer.min_samples=4", "trainer.max_wait_s=3600", 'trainer.baseline="none"')
    with SQLitePool(tmp_path / "a", config.pool) as pool:
        trainer = Trainer(config, pool)

        def once():  # run_once's sequence: lease what `ready` says, then train_step (None: accumulating)
            wanted = trainer.ready()
            lease = pool.lease(wanted, current_version=trainer.version) if wanted else None
            return trainer.train_step(trainer.load(lease)) if lease else None

        add(pool, generations, 0)
        assert once() is None and pool.stats()["leased"] == 1 and trainer.step_count == 0
        assert once() is None  # nothing READY, nothing due: no lease
        add(pool, generations, 1), add(pool, generations, 2)
        assert once() is None and pool.stats()["leased"] == 3
        for i in range(3, 8):
            add(pool, generations, i)
        assert trainer.ready() == 3  # the room left in this version: batch_size - 3
        metrics = once()
        assert metrics is not None and trainer.step_count == 1 and trainer.accumulated is None
        assert metrics["samples"] == 6 and metrics["leases"] == 3 and pool.stats()["leased"] == 6
        assert pool.stats()["ready"] == 2  # the rest waits for the next version
        accumulated = {n: p.grad.clone() for n, p in trainer.policy.named_trainable().items()}
    # The same six samples as one batch give the same update (token mean over all of them).
    config = config_for(tiny_model_dir, tmp_path / "b", 'trainer.method="rl"', "trainer.batch_size=6",
                        'trainer.baseline="none"')
    with SQLitePool(tmp_path / "b", config.pool) as pool:
        one = Trainer(config, pool)
        single = one.train_step([TrainSample(step_of(i, *generations[i]), 1.0 if i % 2 == 0 else -1.0)
                                 for i in range(6)])
    assert single["loss"] == pytest.approx(metrics["loss"], abs=1e-6) and single["tokens"] == metrics["tokens"]
    # The gradient each stepped on is in .grad still (float noise: the micro-batches pad differently;
    # the weights are not compared, Adam's first step is about lr * sign(g) and amplifies that noise).
    for name, weight in one.policy.named_trainable().items():
        assert torch.allclose(weight.grad, accumulated[name], rtol=1e-3, atol=1e-6), name


def test_a_version_steps_when_its_time_is_up_with_nothing_more_ready(tiny_model_dir, tmp_path, generations,
                                                                   monkeypatch):
    import time

    from clawr1.trainer import accumulate

    now = [time.time()]  # the trainer's clock stands still until the test moves it (a slow step is not late)
    monkeypatch.setattr(accumulate, "clock", lambda: now[0])
    config = config_for(tiny_model_dir, tmp_path, 'trainer.method="rl"', "trainer.min_samples=3",
                        "trainer.max_wait_s=0.2")
    with SQLitePool(tmp_path, config.pool) as pool:
        trainer = Trainer(config, pool)
        add(pool, generations, 0)
        assert trainer.train_step(trainer.load(pool.lease(trainer.ready()))) is None
        assert trainer.ready() == 0
        now[0] += 0.25
        wanted = trainer.ready()
        assert wanted == 2  # due: lease whatever is READY (nothing), then step
        metrics = trainer.train_step(trainer.load(pool.lease(wanted)))
        assert metrics["samples"] == 1 and metrics["accumulated_s"] >= 0.2


def test_when_a_version_is_due():
    leased, extra = SimpleNamespace(relabelled=False), SimpleNamespace(relabelled=True)
    config = TrainerConfig(batch_size=8, min_samples=4, max_wait_s=10)
    acc = Accumulated(opened=100.0, samples=[leased] * 3)  # type: ignore[list-item]
    assert not version_due(acc, config, lease_seconds=600, now=105)
    assert version_due(acc, config, lease_seconds=600, now=110)  # max_wait_s
    assert version_due(acc, config, lease_seconds=8, now=104)  # half the lease time: before it expires
    acc.samples.append(extra)  # type: ignore[arg-type]
    assert not version_due(acc, config, lease_seconds=600, now=100)  # a relabelled row is not a sample more
    acc.samples.append(leased)  # type: ignore[arg-type]
    assert version_due(acc, config, lease_seconds=600, now=100)  # min_samples
    unset = TrainerConfig(min_samples=None)
    assert TrainerConfig(min_samples=0).min_samples is None  # TOML's way to unset it
    assert version_due(Accumulated(opened=100.0), unset, lease_seconds=600, now=100)  # unset: every call
    small = TrainerConfig(batch_size=2, min_samples=8, max_wait_s=10)  # the default 8, a --batch-size 2
    assert version_due(Accumulated(opened=100.0, samples=[leased] * 2), small, lease_seconds=600, now=101)  # type: ignore[list-item]
    assert not version_due(Accumulated(opened=100.0, samples=[leased]), small, lease_seconds=600, now=101)  # type: ignore[list-item]


def test_learning_rate_warmup_then_constant():
    config = TrainerConfig(lr=1e-3, warmup_steps=4)
    assert [scheduled_lr(config, s) for s in (1, 2, 4, 100)] == pytest.approx([2.5e-4, 5e-4, 1e-3, 1e-3])
    assert scheduled_lr(TrainerConfig(lr=1e-3, warmup_steps=0), 1) == 1e-3


def test_a_rollback_to_the_base_warms_up_again(tiny_model_dir, tmp_path, generations):
    """The warmup counts the optimizer's own steps: after `clawr1 rollback 0` (a fresh optimizer)
    the next version's first Adam step is at lr / warmup_steps again, not at the full lr."""
    from clawr1.engine import adapters

    config = config_for(tiny_model_dir, tmp_path, "trainer.batch_size=2", "trainer.min_samples=0",
                        "trainer.warmup_steps=4", 'trainer.method="rl"', "guard.enabled=true",
                        "guard.decision_timeout_s=0.05", "trainer.poll_s=0.01")  # no gateway: undecided
    with SQLitePool(tmp_path, config.pool) as pool:
        trainer = Trainer(config, pool)
        lrs = []
        for version in range(3):
            for i in (2 * version, 2 * version + 1):
                add(pool, generations, i, hints=False)
            if version == 2:  # what `clawr1 rollback 0` writes; the trainer applies it first thing
                adapters.set_control(tmp_path / "adapters", "policy", rollback={"to": 0, "id": "r1"})
            lrs.append(trainer.run_once()["lr"])
        assert lrs == pytest.approx([0.0025, 0.005, 0.0025])  # config_for's lr 0.01
        trainer.close()


def test_run_once_acks_every_lease_of_a_version_after_its_checkpoint(tiny_model_dir, tmp_path, generations,
                                                                     monkeypatch):
    config = config_for(tiny_model_dir, tmp_path, "trainer.batch_size=6", "trainer.min_samples=4",
                        "trainer.max_wait_s=3600", 'trainer.baseline="ema"', 'trainer.teacher="ema"')
    with SQLitePool(tmp_path, config.pool) as pool:
        trainer = Trainer(config, pool)
        for i in range(3):
            add(pool, generations, i)
            assert trainer.run_once() is None
        add(pool, generations, 3)

        def crash(lease):
            raise SystemExit("killed between checkpoint and ack")

        monkeypatch.setattr(pool, "ack", crash)
        with pytest.raises(SystemExit):
            trainer.run_once()
        monkeypatch.undo()
        state = json.loads((checkpoint.path_of(tmp_path) / "state.json").read_text())
        assert len(state["lease_ids"]) == 4 and state["reward_baseline"] == trainer.reward_baseline != 0
        ema = {n: t.clone() for n, t in trainer.policy.named_state().items() if n.startswith("ema.")}
        resumed = Trainer(config, pool)  # acks all four leases
        assert pool.stats()["consumed"] == 4 and resumed.reward_baseline == trainer.reward_baseline
        assert all(torch.equal(resumed.policy.named_state()[n], t) for n, t in ema.items())


def test_the_teacher_reads_the_hint_where_hint_at_says(tiny_model_dir, tmp_path, generations):
    from clawr1.trainer.batch import SYSTEM_HINT_PREFIX, with_hint

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    on_user, on_system = with_hint(messages, "No bold.", "user"), with_hint(messages, "No bold.", "system")
    assert on_user[0] == messages[0] and on_user[1]["content"].endswith("No bold.")
    assert on_system[0]["content"] == "Be brief." + SYSTEM_HINT_PREFIX + "No bold." and on_system[1] == messages[1]
    assert with_hint(messages[1:], "No bold.", "system")[0]["role"] == "system"  # one is added when there is none
    assert messages[0]["content"] == "Be brief."  # the step's own messages are never changed
    # The OPD advantages of one batch follow the teacher's context: a different placement, other numbers.
    samples = [TrainSample(step_of(i, *generations[i]), -1.0, hint="Answer in one short sentence.") for i in range(4)]
    opd = {}
    for at in ("user", "system"):
        config = config_for(tiny_model_dir, tmp_path / at, 'trainer.method="opd"', f'trainer.hint_at="{at}"')
        with SQLitePool(tmp_path / at, config.pool) as pool:
            trainer = Trainer(config, pool, resume=False)
            opd[at] = prepare(trainer.policy, samples, trainer.tc, torch.zeros(len(samples))).advantage
    assert opd["user"].abs().sum() > 0 and not torch.allclose(opd["user"], opd["system"])


def test_an_unset_hint_at_is_the_served_models_own(tiny_model_dir, tmp_path):
    """SmolLM2-135M keeps the hint in the user's message (where its demo runs were measured); Qwen's
    converted directory and any other model read it in the system prompt; a set value stays."""
    from clawr1.core.config import Config
    from clawr1.trainer.batch import resolved

    assert Config().trainer.hint_at is None and resolved(Config()).hint_at == "user"
    qwen = Config(engine={"model": str(tmp_path / "models" / "qwen2.5-coder-0.5b-instruct")})
    assert resolved(qwen).hint_at == "system" and qwen.trainer.hint_at is None  # the config is not changed
    assert resolved(Config(engine={"model": "/models/smollm2-135m-instruct"})).hint_at == "user"
    assert resolved(Config(engine={"model": "/models/smollm2-135m-instruct"}, trainer={"hint_at": "system"})).hint_at \
        == "system"
    with SQLitePool(tmp_path, Config().pool) as pool:  # the trainer trains with the resolved one
        trainer = Trainer(config_for(tiny_model_dir, tmp_path, 'trainer.method="opd"'), pool, resume=False)
        assert trainer.tc.hint_at == "system"


def test_an_admin_rollback_applies_with_the_guard_off(tiny_model_dir, tmp_path, generations):
    """The guard off (every version served as published): `clawr1 rollback 1` puts v1's weights back
    in the trainer, with a fresh optimizer, and the next version trains on from them."""
    from safetensors.torch import load_file

    from clawr1.engine import adapters

    config = config_for(tiny_model_dir, tmp_path, "trainer.batch_size=2", "trainer.min_samples=0",
                        'trainer.method="rl"', "guard.enabled=false")
    with SQLitePool(tmp_path, config.pool) as pool:
        trainer = Trainer(config, pool)
        for version in range(3):
            for i in (2 * version, 2 * version + 1):
                add(pool, generations, i, hints=False)
            assert trainer.run_once()["version"] == version + 1
        assert trainer.promoted == 3  # served as published: each version is the incumbent
        v1 = load_file(adapters.version_dir(tmp_path / "adapters", "policy", 1) / "adapter_model.safetensors")
        adapters.set_control(tmp_path / "adapters", "policy", rollback={"to": 1, "id": "r1"})
        assert trainer.run_once() is None  # nothing to train; the rollback is applied first thing
        assert trainer.promoted == trainer.weights_of == 1 and trainer.rollbacks == ["r1"]
        held = {n.replace(".policy.", "."): t for n, t in trainer.policy.named_trainable().items()}
        assert set(v1) <= set(held) and any("lora_B" in key and value.abs().sum() > 0 for key, value in v1.items())
        for key, value in v1.items():
            assert torch.equal(held[key].detach().cpu(), value), key
        trainer.apply_rollback()  # applied once: the same request id is not applied again
        assert trainer.rollbacks == ["r1"]
        for i in (6, 7):
            add(pool, generations, i, hints=False)
        assert trainer.run_once()["version"] == 4 and trainer.promoted == 4
        # v4 says it was trained after r1, so the gateway serves it (one trained before would not be).
        assert adapters.read_marker(adapters.version_dir(tmp_path / "adapters", "policy", 4))["rollback"] == "r1"
        assert adapters.read_marker(adapters.version_dir(tmp_path / "adapters", "policy", 3))["rollback"] is None
        trainer.close()


def test_a_per_sample_average_weighs_every_reply_alike(tiny_model_dir, tmp_path, generations):
    """`trainer.loss_average = "sample"`: a 3-token reply's tokens carry (mean length / 3) times the
    advantage a 12-token reply's carry, so the policy-gradient term is the mean of the two replies'
    token means; one step then raises the short +1 reply's logprob more than the token average does
    (its end is worth as much as the long reply's twelve tokens)."""
    from dataclasses import replace

    from clawr1.trainer.batch import per_sample

    short = replace(step_of(0, *generations[0]), token_ids=generations[0][1].token_ids[:3],
                    logprobs=generations[0][1].logprobs[:3])
    samples = [TrainSample(short, 1.0), TrainSample(step_of(1, *generations[1]), -1.0)]
    assert len(samples[1].step.token_ids) == 12
    config = TrainerConfig(method="rl", loss_average="sample")
    weighted = per_sample(samples, config)
    assert [s.weight for s in weighted] == pytest.approx([7.5 / 3, 7.5 / 12])
    assert per_sample(samples, TrainerConfig(method="rl")) == samples
    # A sample without a signal trains nothing and does not move the mean; an empty reply keeps its weight.
    idle = TrainSample(replace(step_of(2, *generations[2]), step_id="idle"), None)
    empty = TrainSample(replace(step_of(3, *generations[3]), step_id="empty", token_ids=[], logprobs=[]), 1.0)
    assert [s.weight for s in per_sample([*samples, idle, empty], config)][:2] == pytest.approx([7.5 / 3, 7.5 / 12])
    assert per_sample([*samples, idle, empty], config)[3].weight == 1.0
    m = prepare(trained(tiny_model_dir, tmp_path / "p", samples, 0).policy, weighted, config, torch.tensor([1.0, -1.0]))
    per_token = (m.advantage * m.mask).sum(dim=1) / m.mask.sum(dim=1)
    assert per_token.tolist() == pytest.approx([7.5 / 3, -7.5 / 12])
    assert float((m.advantage * m.mask).sum() / m.mask.sum()) == pytest.approx(0.0, abs=1e-6)  # (1 - 1) / 2

    gains = {}
    for average in ("token", "sample"):
        trainer = trained(tiny_model_dir, tmp_path / average, samples, 0, f'trainer.loss_average="{average}"',
                          "trainer.warmup_steps=0", "trainer.kl_coef=0")
        before = trainer.sequence_logprob(short.prompt_ids, short.token_ids)
        trainer.train_step(per_sample(samples, trainer.tc))
        gains[average] = trainer.sequence_logprob(short.prompt_ids, short.token_ids) - before
    assert gains["sample"] > gains["token"] > 0, gains

    from clawr1.core.records import Reward

    config = config_for(tiny_model_dir, tmp_path / "lease", 'trainer.loss_average="sample"', "trainer.batch_size=2")
    with SQLitePool(tmp_path / "lease", config.pool) as pool:  # the trainer weighs what it leases
        for sample in samples:
            pool.append_step(sample.step)
            pool.add_reward(Reward(step_id=sample.step.step_id, score=sample.reward, source="test"))
        leased = {s.step.step_id: s.weight for s in Trainer(config, pool).take()}
        assert leased == pytest.approx({"st-0": 7.5 / 3, "st-1": 7.5 / 12})
