"""The trainer on the tiny model and a real pool: exact logprobs, resume equivalence, exactly-once."""

from __future__ import annotations

import itertools

import pytest
import torch

from clawr1.core.config import load_config
from clawr1.core.records import Hint, Reward, Step
from clawr1.datapool import SQLitePool
from clawr1.engine import adapters
from clawr1.trainer import checkpoint
from clawr1.trainer.loop import Trainer
from clawr1.trainer.policy import ADAPTER


def step_of(i: int, messages, gen) -> Step:
    return Step(step_id=f"st-{i}", tenant="default", session_id=f"s{i}", prompt_id=f"s{i}", turn_index=0,
                turn_type="main", messages=messages, tools=None, prompt_ids=gen.prompt_ids,
                token_ids=gen.token_ids, logprobs=gen.logprobs, text=gen.text, policy_version=0, adapter=None,
                finish_reason=gen.finish_reason, temperature=gen.temperature)


def add(pool: SQLitePool, generations, i: int, hints: bool = True) -> str:
    """Sample i of `generations`, rewarded +1 (even i) or -1 (odd), with a hint every third."""
    step = step_of(i, *generations[i])
    pool.append_step(step)
    pool.add_reward(Reward(step_id=step.step_id, score=1.0 if i % 2 == 0 else -1.0, source="test"))
    if hints and i % 3 == 0:
        pool.add_hint(Hint(step_id=step.step_id, text="Answer in one short sentence.", source="judge"))
    return step.step_id


def fill(pool: SQLitePool, generations, hints: bool = True) -> list[str]:
    return [add(pool, generations, i, hints) for i in range(len(generations))]


def config_for(tiny_model_dir, data_dir, *extra):
    return load_config(None, [f'data_dir="{data_dir}"', f'engine.model="{tiny_model_dir}"', "trainer.batch_size=3",
                              "trainer.micro_batch=2", "trainer.max_wait_s=0", "trainer.lr=0.01",
                              "guard.enabled=false", *extra])  # the trainer alone (its guard side: test_guard.py)


def test_policy_logprobs_match_the_engine_before_training(tiny_model_dir, tmp_path, generations):
    config = config_for(tiny_model_dir, tmp_path)
    with SQLitePool(tmp_path, config.pool) as pool:
        trainer = Trainer(config, pool)
        for _, gen in generations[:4]:
            mine = trainer.sequence_logprob(gen.prompt_ids, gen.token_ids, gen.temperature)
            assert mine == pytest.approx(sum(gen.logprobs), abs=1e-3)  # ratio 1 at v0: same tokens, same maths


def test_steps_publish_versions_and_change_the_lora(tiny_model_dir, tmp_path, generations):
    config = config_for(tiny_model_dir, tmp_path, 'trainer.method="combine"')
    with SQLitePool(tmp_path, config.pool) as pool:
        fill(pool, generations)
        trainer = Trainer(config, pool)
        before = {n: p.detach().clone() for n, p in trainer.policy.named_trainable().items()}
        first, second = trainer.run_once(), trainer.run_once()
        assert (first["version"], second["version"]) == (1, 2)
        assert adapters.latest(tmp_path / "adapters", ADAPTER)[0] == 2
        changed = [n for n, p in trainer.policy.named_trainable().items() if not torch.equal(p, before[n])]
        assert len(changed) == len(before)  # after two steps every LoRA matrix moved (B first, then A)
        assert pool.stats()["consumed"] == 6 and first["hint_rate"] > 0
        lines = (tmp_path / "trainer" / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 2
        assert list((tmp_path / "trainer" / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.system  # wandb starts its own service process per run
def test_wandb_run_mirrors_the_metrics_and_resumes_under_one_id(tiny_model_dir, tmp_path, generations, monkeypatch):
    pytest.importorskip("wandb", reason="pip install wandb (a test dependency)")
    monkeypatch.setenv("WANDB_MODE", "offline")  # a real run, written locally: no account, no network
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = config_for(tiny_model_dir, tmp_path, 'trainer.wandb_project="clawr1-test"',
                        'gateway.admin_key="secret-admin-key-123"')
    with SQLitePool(tmp_path, config.pool) as pool:
        fill(pool, generations)
        for _ in range(2):  # two trainer lives, one run
            trainer = Trainer(config, pool)
            assert trainer.run_once() is not None
            trainer.close()
    runs = list((tmp_path / "trainer" / "wandb").glob("offline-run-*/run-*.wandb"))
    run_id = (tmp_path / "trainer" / "wandb-run-id").read_text()
    assert len(runs) == 2 and all(run.name == f"run-{run_id}.wandb" for run in runs)
    logged = b"".join(run.read_bytes() for run in runs)
    assert b"trainer/loss" in logged and b"trainer/reward_mean" in logged and b"lora_rank" in logged
    assert b"secret-admin-key-123" not in logged  # the run's config never carries a key


def _losses(trainer, n):
    return [trainer.run_once()["loss"] for _ in range(n)]


def test_resume_is_exact(tiny_model_dir, tmp_path, generations):
    straight_dir, resumed_dir = tmp_path / "a", tmp_path / "b"
    config = config_for(tiny_model_dir, straight_dir)
    with SQLitePool(straight_dir, config.pool) as pool:
        fill(pool, generations)
        straight = _losses(Trainer(config, pool), 4)
    config = config_for(tiny_model_dir, resumed_dir)
    with SQLitePool(resumed_dir, config.pool) as pool:
        fill(pool, generations)
        first = _losses(Trainer(config, pool), 2)
        resumed = Trainer(config, pool)  # a new process would do exactly this
        assert (resumed.step_count, resumed.version) == (2, 2)
        second = _losses(resumed, 2)
    assert first + second == pytest.approx(straight, abs=1e-4)
    assert straight[0] != pytest.approx(straight[3], abs=1e-6)  # the steps really differ


def test_crash_after_checkpoint_before_ack_trains_nothing_twice(tiny_model_dir, tmp_path, generations, monkeypatch):
    config = config_for(tiny_model_dir, tmp_path)
    with SQLitePool(tmp_path, config.pool) as pool:
        fill(pool, generations[:6])
        trainer = Trainer(config, pool)
        trained = []
        real_load = Trainer.load

        def spy(self, lease):
            trained.extend(lease.step_ids)
            return real_load(self, lease)

        monkeypatch.setattr(Trainer, "load", spy)

        def crash(lease):
            raise SystemExit("killed between checkpoint and ack")

        monkeypatch.setattr(pool, "ack", crash)
        with pytest.raises(SystemExit):
            trainer.run_once()
        monkeypatch.undo()
        monkeypatch.setattr(Trainer, "load", spy)
        resumed = Trainer(config, pool)  # acks the checkpointed lease
        assert pool.stats()["consumed"] == 3
        while resumed.run_once() is not None:
            pass
        assert sorted(trained) == sorted(f"st-{i}" for i in range(6))  # each exactly once
        assert pool.stats()["consumed"] == 6


def test_crash_before_checkpoint_returns_the_samples(tiny_model_dir, tmp_path, generations, monkeypatch, pool_later):
    config = config_for(tiny_model_dir, tmp_path, "pool.lease_seconds=60")
    with SQLitePool(tmp_path, config.pool) as pool:
        fill(pool, generations[:3])
        trainer = Trainer(config, pool)

        def crash(*args, **kwargs):
            raise SystemExit("killed before the checkpoint")

        with monkeypatch.context() as patch, pytest.raises(SystemExit):
            patch.setattr(checkpoint, "save", crash)
            trainer.run_once()
        assert pool.stats()["leased"] == 3
        pool_later(61)
        resumed = Trainer(config, pool)  # no checkpoint: starts from scratch, keeps the published number
        assert resumed.version == 1 and resumed.step_count == 0
        metrics = resumed.run_once()  # the expired lease's samples came back
        assert metrics["lease"] == 3 and metrics["version"] == 2
        assert pool.stats()["consumed"] == 3


def test_a_batch_without_a_trainable_token_is_acknowledged_without_a_version(tiny_model_dir, tmp_path, generations):
    """`opd` with no hints: nothing trains, so no new version is published (it would be the same
    weights under a new number), yet the samples are consumed and the skip is counted."""
    config = config_for(tiny_model_dir, tmp_path, 'trainer.method="opd"')
    with SQLitePool(tmp_path, config.pool) as pool:
        fill(pool, generations[:3], hints=False)
        trainer = Trainer(config, pool)
        assert trainer.run_once() is None
        assert trainer.skipped == 1 and trainer.version == 0 and trainer.step_count == 0
        assert adapters.latest(tmp_path / "adapters", ADAPTER) is None
        assert pool.stats()["consumed"] == 3


def test_full_vocabulary_opd_moves_the_policy_to_the_hinted_teacher(tiny_model_dir, tmp_path, generations):
    """`opd_estimator = "full"`: OPD is the KL to the hint-informed teacher at every reply position.
    A few steps on the same hinted samples bring the policy closer to that teacher, and raise the
    probability of the tokens the teacher prefers where the policy sampled something else: what the
    sampled estimator, which only sees sampled tokens, cannot aim at."""
    from clawr1.trainer.batch import TrainSample, _teacher_rows
    from clawr1.trainer.policy import pack

    config = config_for(tiny_model_dir, tmp_path, 'trainer.method="opd"', 'trainer.opd_estimator="full"',
                        "trainer.kl_coef=0", "trainer.batch_size=6", "trainer.micro_batch=6")
    hint = "Answer in one short sentence."
    with SQLitePool(tmp_path, config.pool) as pool:
        trainer = Trainer(config, pool, resume=False)
        policy = trainer.policy
        samples = [TrainSample(step_of(i, *generations[i]), None, hint=hint) for i in range(6)]
        steps = [s.step for s in samples]
        rows = pack([s.prompt_ids for s in steps], [s.token_ids for s in steps], [s.temperature for s in steps],
                    policy.pad_id)
        with torch.no_grad(), policy.adapter_off():
            teacher = policy.distributions(_teacher_rows(policy, samples, list(range(6)), trainer.tc.hint_at))
        favourite = teacher[:, -rows.targets.shape[1]:].argmax(-1)  # the teacher's top token per position
        elsewhere = (favourite != rows.targets) & (rows.mask > 0)
        assert elsewhere.sum() >= 5

        def favourite_logp() -> float:
            with torch.no_grad():
                logp = policy.distributions(rows).gather(-1, favourite[..., None]).squeeze(-1)
            return float(logp[elsewhere].mean())

        before_logp = favourite_logp()
        kls = [trainer.train_step(samples)["kl_teacher"] for _ in range(5)]
        assert all(b < a for a, b in itertools.pairwise(kls)) and kls[-1] < 0.85 * kls[0], kls
        assert favourite_logp() > before_logp + 0.1


def test_the_stop_term_moves_the_chance_of_ending_to_the_hinted_teacher(tiny_model_dir, tmp_path, generations):
    """`stop_coef`: at every reply position of a hinted sample, the policy's probability of ending
    the reply there is pulled to the hinted teacher's (base weights, the hint in the context).
    Steps on the same samples shrink that gap; without the term, OPD on the sampled tokens alone
    moves it less."""
    from clawr1.trainer.batch import TrainSample, _right_aligned, _teacher_rows
    from clawr1.trainer.losses import masked_mean, stop_kl
    from clawr1.trainer.policy import pack

    hint = "Answer in one short sentence."
    samples = [TrainSample(step_of(i, *generations[i]), None, hint=hint) for i in range(6)]
    steps = [s.step for s in samples]
    common = max({t for s in steps for t in s.token_ids}, key=lambda t: sum(s.token_ids.count(t) for s in steps))

    def gap(trainer: Trainer) -> float:
        """KL(teacher || policy) of the stop decision, a mean over the reply positions."""
        policy = trainer.policy
        rows = pack([s.prompt_ids for s in steps], [s.token_ids for s in steps], [s.temperature for s in steps],
                    policy.pad_id)
        with policy.adapter_off():
            teacher = policy.logprobs_and_stop(_teacher_rows(policy, samples, list(range(6)), trainer.tc.hint_at))[1]
        teacher = _right_aligned(teacher, samples, list(range(6)), rows.targets.shape[1])
        return float(masked_mean(stop_kl(teacher, policy.logprobs_and_stop(rows)[1]), rows.mask))

    gaps = {}
    for coef in (0.0, 50.0):
        config = config_for(tiny_model_dir, tmp_path / str(coef), 'trainer.method="opd"', "trainer.kl_coef=0",
                            f"trainer.stop_coef={coef}", "trainer.batch_size=6", "trainer.micro_batch=6")
        with SQLitePool(tmp_path / str(coef), config.pool) as pool:
            trainer = Trainer(config, pool, resume=False)
            with torch.no_grad():  # the tiny model's end-of-turn row is its (zeroed) padding row: make it a
                # word's, so ending is as likely as that word (the base's, teacher and policy alike)
                for end in trainer.policy.stop_ids:
                    trainer.policy.head[end] = trainer.policy.head[common]
            first = gap(trainer)
            metrics = [trainer.train_step(samples) for _ in range(5)]
            gaps[coef] = (first, gap(trainer))
    (start, with_term), (start_without, without) = gaps[50.0], gaps[0.0]
    assert start == pytest.approx(start_without) and start > 0  # the same policy and teacher at v0
    assert metrics[-1]["kl_stop"] < metrics[0]["kl_stop"] and metrics[0]["p_stop_teacher"] > 0
    assert with_term < 0.5 * start, gaps
    assert with_term < 0.5 * without, gaps


def test_epochs_step_again_on_the_same_samples_within_the_clip(tiny_model_dir, tmp_path, generations):
    """`trainer.epochs = 3`: one version is three optimizer steps on one batch. Each later pass
    sees the moved policy (ratios off 1, some clipped) and the surrogate it minimises has fallen;
    one epoch at the same settings moves the LoRA less."""
    moved = {}
    for epochs in (1, 3):
        config = config_for(tiny_model_dir, tmp_path / str(epochs), 'trainer.method="rl"', "trainer.kl_coef=0",
                            "trainer.batch_size=6", "trainer.micro_batch=3", f"trainer.epochs={epochs}")
        with SQLitePool(tmp_path / str(epochs), config.pool) as pool:
            for i in range(6):
                add(pool, generations, i, hints=False)
            trainer = Trainer(config, pool, resume=False)
            before = {n: p.detach().clone() for n, p in trainer.policy.named_trainable().items()}
            metrics = trainer.run_once()
            assert metrics["version"] == 1 and trainer.step_count == epochs and metrics["epochs"] == epochs
            moved[epochs] = sum(float((p.detach() - before[n]).norm()) for n, p in trainer.policy.named_trainable().items())
            if epochs == 1:
                assert "last_ratio" not in metrics
                continue
            assert metrics["ratio"] == pytest.approx(1.0, abs=1e-3)  # the first pass: the sampler's policy
            assert abs(metrics["last_ratio"] - 1.0) > 1e-3 and metrics["last_clip_frac"] > 0
            assert metrics["last_loss"] < metrics["loss"]
    assert moved[3] > 1.5 * moved[1]


def test_hindsight_relabelling_trains_the_accepted_reply_as_the_answer_before_the_correction(
        tiny_model_dir, tmp_path, generations):
    """`trainer.relabel`: turn 1 was corrected (-1, a hint), turn 2 was accepted (+1). The lease
    then also trains turn 2's tokens after turn 1's prompt, both as stored, and that pair's
    logprob rises more than when the trainer learns from the two turns alone. Without the
    correction (turn 1 not hinted), nothing is relabelled."""
    (q_messages, first), (_, second) = generations[0], generations[1]
    correction = [*q_messages, {"role": "assistant", "content": first.text},
                  {"role": "user", "content": "Shorter, please."}]

    def store(pool, hinted: bool) -> None:
        for turn, (messages, gen) in enumerate([(q_messages, first), (correction, second)]):
            pool.append_step(Step(step_id=f"t{turn}", tenant="default", session_id="s", prompt_id=f"p{turn}",
                                  turn_index=turn, turn_type="main", messages=messages, tools=None,
                                  prompt_ids=gen.prompt_ids, token_ids=gen.token_ids, logprobs=gen.logprobs,
                                  text=gen.text, policy_version=0, adapter=None, finish_reason=gen.finish_reason,
                                  temperature=gen.temperature))
        pool.add_reward(Reward(step_id="t0", score=-1.0, source="test"))
        if hinted:
            pool.add_hint(Hint(step_id="t0", text="Answer in one short sentence.", source="judge"))
        pool.add_reward(Reward(step_id="t1", score=1.0, source="test"))

    gains = {}
    for relabel, hinted in ((1.0, True), (0.0, True), (1.0, False)):
        data_dir = tmp_path / f"{relabel}-{hinted}"
        config = config_for(tiny_model_dir, data_dir, 'trainer.method="rl"', "trainer.kl_coef=0",
                            "trainer.batch_size=2", f"trainer.relabel={relabel}")
        with SQLitePool(data_dir, config.pool) as pool:
            store(pool, hinted)
            trainer = Trainer(config, pool, resume=False)
            lease = pool.lease(2, current_version=0)
            rows = trainer.load(lease)
            extra = [r for r in rows if r.relabelled]
            if relabel and hinted:
                [row] = extra
                assert (row.step.prompt_ids, row.step.token_ids) == (first.prompt_ids, second.token_ids)
                assert row.reward == 1.0 and row.step.messages == q_messages and row.lease_id is None
            else:
                assert extra == []
            before = trainer.sequence_logprob(first.prompt_ids, second.token_ids, second.temperature)
            metrics = trainer.train_step(rows)
            assert metrics is not None and metrics["samples"] == 2 and metrics["relabelled"] == len(extra)
            gains[(relabel, hinted)] = trainer.sequence_logprob(first.prompt_ids, second.token_ids,
                                                                second.temperature) - before
            pool.ack(lease.lease_id)
    assert gains[(1.0, True)] > 0 and gains[(1.0, True)] > gains[(0.0, True)] + 0.1


def test_the_teacher_of_a_raw_prompt_step_sees_its_prompt_and_the_hint(tiny_model_dir):
    """`/v1/completions` stores no messages: the teacher's context is then the hint in front of the
    step's own prompt tokens (it once was the hint alone, so every reply token scored as noise)."""
    from clawr1.engine.chat import ChatFormat
    from clawr1.engine.tokenizer import load_tokenizer
    from clawr1.trainer.batch import hinted_prompt, with_hint

    chat = ChatFormat(load_tokenizer(tiny_model_dir))
    prompt = chat.tokenizer.encode("Translate to French: the cat sleeps.", add_special_tokens=False)

    def step(messages):
        return Step(step_id="c-0", tenant="default", session_id="s", prompt_id="p", turn_index=0, turn_type="main",
                    messages=messages, tools=None, prompt_ids=prompt, token_ids=[5, 6], logprobs=[-1.0, -1.0],
                    text="x", policy_version=0, adapter=None, finish_reason="stop", temperature=1.0)

    raw = hinted_prompt(chat, step([]), "Say 'le chat dort'.")
    assert raw[-len(prompt):] == prompt and len(raw) > len(prompt)
    assert "le chat dort" in chat.tokenizer.decode(raw[:-len(prompt)])
    conversation = [{"role": "user", "content": "Translate to French: the cat sleeps."}]
    assert hinted_prompt(chat, step(conversation), "Say it.") == chat.render(with_hint(conversation, "Say it."), None)


def test_a_sample_out_of_memory_alone_is_given_back_then_dropped_as_poison_and_the_trainer_lives(
        tiny_model_dir, tmp_path, generations, monkeypatch, caplog):
    """A sample over the token budget trains alone, and on a GPU its pass can run out of memory:
    the error killed the trainer, the lease came back after its expiry, and the sample killed the
    next trainer too. The trainer now gives the version's leases back at once, the failing pass's
    sample charged an attempt; at `pool.max_lease_attempts` the pool drops it as poison, and the
    others train."""
    from clawr1.trainer import loop

    config = config_for(tiny_model_dir, tmp_path, "trainer.micro_batch=1", "pool.max_lease_attempts=2")
    real_prepare = loop.prepare

    def prepare(policy, samples, tc, rl):
        if any(s.step.step_id == "st-1" for s in samples):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore detail")
        return real_prepare(policy, samples, tc, rl)

    monkeypatch.setattr(loop, "prepare", prepare)
    with SQLitePool(tmp_path, config.pool) as pool, caplog.at_level("WARNING"):
        fill(pool, generations[:3])
        trainer = Trainer(config, pool)
        before = {k: v.clone() for k, v in trainer.policy.named_trainable().items()}
        assert trainer.run_once() is None and trainer.failed_versions == 1 and trainer.version == 0
        assert pool.stats()["ready"] == 3  # given back at once, not at the lease's expiry
        [failure] = [e for e in pool.show("s1", kind="session")["events"] if e["kind"] == "lease_failed"]
        assert failure["data"]["error"] == "out of memory: CUDA out of memory. Tried to allocate 20.00 GiB"
        assert not [e for e in pool.show("s0", kind="session")["events"] if e["kind"] == "lease_failed"]
        assert trainer.run_once() is None and trainer.failed_versions == 2
        assert pool.stats()["dropped_by_reason"] == {"poison": 1}
        metrics = trainer.run_once()
        assert metrics["version"] == 1 and metrics["samples"] == 2 and metrics["failed_versions"] == 2
        assert pool.stats()["consumed"] == 2
        assert any(not torch.equal(before[k], v) for k, v in trainer.policy.named_trainable().items())
        trainer.close()
    assert "sample st-1 dropped as poison" in caplog.text and "training failed (out of memory" in caplog.text


def test_a_non_finite_gradient_skips_the_step_and_publishes_nothing(tiny_model_dir, tmp_path, generations,
                                                                     monkeypatch, caplog):
    """A NaN in the gradients made every weight NaN after AdamW's step, and that adapter was
    published (with the guard off, served) and trained on for good. The step is skipped, counted
    and logged; the weights stay; the leases go back; the next batch trains as usual."""
    config = config_for(tiny_model_dir, tmp_path)
    real_loss = Trainer.loss

    def nan_loss(self, m):
        loss, stats = real_loss(self, m)
        return loss * float("nan"), stats

    with SQLitePool(tmp_path, config.pool) as pool, caplog.at_level("WARNING"):
        fill(pool, generations[:3])
        trainer = Trainer(config, pool)
        before = {k: v.clone() for k, v in trainer.policy.named_trainable().items()}
        with monkeypatch.context() as patch:
            patch.setattr(Trainer, "loss", nan_loss)
            assert trainer.run_once() is None
        assert (trainer.nonfinite_steps, trainer.step_count, trainer.version) == (1, 0, 0)
        assert all(torch.equal(before[k], v) for k, v in trainer.policy.named_trainable().items())
        assert adapters.latest(tmp_path / "adapters", ADAPTER) is None and pool.stats()["ready"] == 3
        assert "gradient norm nan: optimizer step skipped" in caplog.text
        metrics = trainer.run_once()  # the same samples, a finite gradient: trained
        assert metrics["version"] == 1 and metrics["nonfinite_steps"] == 1
        moved = trainer.policy.named_trainable()
        assert all(torch.isfinite(v).all() for v in moved.values())
        assert any(not torch.equal(before[k], moved[k]) for k in before)
        trainer.close()


def test_a_checkpoint_loads_onto_the_cpu_from_any_device_and_runs_no_code(tiny_model_dir, tmp_path, generations,
                                                                           monkeypatch):
    """The optimizer file was read with `torch.load(weights_only=False)` and no `map_location`:
    state saved on `cuda:1` failed where one GPU (or none) is visible, and whoever could write the
    trainer's folder could run code in it. It loads onto the CPU now, as tensors and plain data
    only; a pickle that would run something is refused."""
    import pickle

    import torch.serialization

    config = config_for(tiny_model_dir, tmp_path)
    with SQLitePool(tmp_path, config.pool) as pool:
        fill(pool, generations[:3])
        trainer = Trainer(config, pool)
        with monkeypatch.context() as patch:  # the tensors' storage recorded as on a second GPU
            patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:1")
            assert trainer.run_once()["version"] == 1
        want = {k: v.clone() for k, v in trainer.policy.named_trainable().items()}
        trainer.close()
        resumed = Trainer(config, pool)
        assert (resumed.step_count, resumed.version) == (1, 1)
        assert all(torch.equal(want[k], v) for k, v in resumed.policy.named_trainable().items())
        resumed.close()

        marker = tmp_path / "ran"

        class Payload:
            def __reduce__(self):
                return (marker.touch, ())

        path = checkpoint.path_of(tmp_path) / "optimizer.pt"
        saved = torch.load(path, map_location="cpu", weights_only=True)
        torch.save({**saved, "extra": Payload()}, path)
        with pytest.raises(pickle.UnpicklingError):
            Trainer(config, pool)
        assert not marker.exists()


def test_a_version_trained_from_little_that_is_useful_says_so(tiny_model_dir, tmp_path, generations, caplog):
    """Under `opd`, rewarded samples without a hint carry no signal: a version made mostly of them is
    counted (`no_signal`, the dashboard's column) and said in the log, not silently published."""
    config = config_for(tiny_model_dir, tmp_path, 'trainer.method="opd"', "trainer.batch_size=6")
    with SQLitePool(tmp_path, config.pool) as pool:
        for i in range(6):
            add(pool, generations, i, hints=False)
        pool.add_hint(Hint(step_id="st-0", text="Answer in one short sentence.", source="judge"))
        trainer = Trainer(config, pool, resume=False)
        with caplog.at_level("WARNING", logger="clawr1.trainer.loop"):
            metrics = trainer.run_once()
    assert metrics["version"] == 1 and (metrics["samples"], metrics["no_signal"]) == (6, 5)
    assert "1 of 6 samples had a signal" in caplog.text
    # v1 is the first step from the base: its KL is 0 by construction, not a silent KL term.
    assert trainer.tc.kl_coef > 0 and metrics["kl"] == 0.0 and metrics["kl_silent"] == 0
    assert "configured but 0" not in caplog.text


def test_each_version_counts_the_turns_that_left_training_unused(tiny_model_dir, tmp_path, generations, caplog):
    """`lost_<why>` per version: turns the pool dropped since the version before (a session that
    closed before its last turn had feedback: `masked`) and turns the judge gave up on (`judge`),
    so learning that silently runs dry is seen on the version it starves; and the log says it."""
    config = config_for(tiny_model_dir, tmp_path)
    with SQLitePool(tmp_path, config.pool) as pool:
        pool.append_step(step_of(90, *generations[0]))
        pool.close_session("s90", None, reason="idle")  # masked before the trainer started: not this version's
        trainer = Trainer(config, pool)
        for i in range(3):
            add(pool, generations, i)
        for i in (91, 92):  # two more closed without feedback, and one the judge gave up on
            pool.append_step(step_of(i, *generations[i - 90]))
            pool.close_session(f"s{i}", None, reason="idle")
        pool.append_step(step_of(93, *generations[3]))
        assert pool.judge_failed("st-93", "TimeoutError: the judge took too long", 1, 1.0)
        with caplog.at_level("WARNING", logger="clawr1.trainer.loop"):
            metrics = trainer.run_once()
        assert metrics["version"] == 1
        assert metrics["lost_masked"] == 2 and metrics["lost_judge"] == 1 and metrics["lost_stale"] == 0
        assert "3 turns left training unused since v0 (masked 2, judge 1)" in caplog.text  # 3 lost, 3 trained
        for i in range(3, 6):
            add(pool, generations, i)
        assert trainer.run_once()["lost_masked"] == 0  # counted once, on the version it was lost before
