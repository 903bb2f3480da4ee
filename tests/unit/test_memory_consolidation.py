"""Consolidation of per-user memory into the weights (context distillation), and entries retired
once the weights have learned them (and back when a later version forgets)."""

from __future__ import annotations

from dataclasses import replace

import torch

from clawr1.core import memory
from clawr1.core.records import Hint, Reward, Step
from clawr1.core.types import SamplingParams
from clawr1.datapool import SQLitePool
from clawr1.trainer import consolidate
from clawr1.trainer.batch import memory_gap_means
from clawr1.trainer.loop import Trainer
from clawr1.trainer.policy import pack
from tests.conftest import run
from tests.unit.test_trainer import config_for

PREFERENCE = "Answer in one short sentence, without lists."


async def sample(engine, prompt: list[int], seed: int):
    return await engine.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=seed)).final()


def remembered_steps(pool: SQLitePool, engine, generations, n: int) -> tuple[int, list[Step]]:
    """A user (`user:ann`) corrected once (an entry); then `n` turns whose prompts carried that
    entry, as the gateway serves them (`memory.add_to` before the template renders), each reply
    sampled by the tiny engine after that prompt."""
    first_messages, first = generations[0]
    pool.append_step(Step(step_id="c0", tenant="default", session_id="s-c", prompt_id="c0", turn_index=0,
                          turn_type="main", messages=first_messages, tools=None, prompt_ids=first.prompt_ids,
                          token_ids=first.token_ids, logprobs=first.logprobs, text=first.text, policy_version=0,
                          adapter=None, finish_reason=first.finish_reason, temperature=first.temperature,
                          memory={"user": "user:ann"}))
    pool.add_hint(Hint(step_id="c0", text=PREFERENCE, source="feedback"))  # (a judge's needs user text next)
    [entry] = pool.memory()
    steps = []
    for i in range(1, n + 1):
        messages = generations[i][0]
        served, added, at = memory.add_to(messages, memory.block([entry["text"]]))
        prompt = engine.render(served)
        gen = run(sample(engine, prompt, i))
        steps.append(Step(step_id=f"m{i}", tenant="default", session_id=f"s{i}", prompt_id=f"m{i}", turn_index=0,
                          turn_type="main", messages=served, tools=None, prompt_ids=prompt,
                          token_ids=gen.token_ids, logprobs=gen.logprobs, text=gen.text, policy_version=0,
                          adapter=None, finish_reason=gen.finish_reason, temperature=gen.temperature,
                          memory=memory.record("user:ann", [(entry["id"], entry["text"])], added, at)))
    pool.append_steps(steps)
    for step in steps:  # rewarded, so the steps are READY; `opd` trains them only through their memory
        pool.add_reward(Reward(step_id=step.step_id, score=1.0, source="test"))
    return entry["id"], steps


def test_a_step_that_carried_memory_also_trains_the_student_without_it(tiny_model_dir, tmp_path, engine,
                                                                         generations):
    """The consolidation row is the step's reply after the prompt as the client sent it (no memory),
    taught by the prompt as served; training on it shrinks what the memory adds (the teacher's
    reminded logprob over the version's unreminded one) and changes the LoRA weights. With
    `memory.distill_weight = 0` there is no such row, and `opd` has nothing to train on."""
    config = config_for(tiny_model_dir, tmp_path, 'trainer.method="opd"', "trainer.kl_coef=0",
                        "trainer.batch_size=4", "trainer.micro_batch=4", "trainer.lr=0.02")
    with SQLitePool(tmp_path, config.pool) as pool:
        trainer = Trainer(config, pool, resume=False)
        chat = trainer.policy.chat
        entry, steps = remembered_steps(pool, engine, generations, 4)
        lease = pool.lease(4, current_version=0)
        rows = trainer.load(lease)
        extra = [r for r in rows if r.memory]
        assert len(extra) == 4 and all(r.memory == (entry,) and r.reward is None and r.lease_id is None for r in extra)
        by_id = {s.step_id: s for s in steps}
        for row in extra:
            step = by_id[row.step.step_id.removesuffix(":memory")]
            assert row.teacher_prompt == step.prompt_ids  # the teacher: the prompt as served
            assert row.step.messages == memory.without(step.messages, step.memory)  # the student: as sent
            assert row.step.prompt_ids == chat.render(row.step.messages, None) != step.prompt_ids
            assert memory.HEADER not in chat.tokenizer.decode(row.step.prompt_ids)
            assert row.step.token_ids == step.token_ids

        def gap() -> float:
            """Teacher (base, reminded) minus the policy (not reminded), nats a token, on these replies."""
            unreminded = pack([r.step.prompt_ids for r in extra], [r.step.token_ids for r in extra],
                              [r.step.temperature for r in extra], trainer.policy.pad_id)
            reminded = pack([r.teacher_prompt for r in extra], [r.step.token_ids for r in extra],
                            [r.step.temperature for r in extra], trainer.policy.pad_id)
            with torch.no_grad():
                student = trainer.policy.logprobs(unreminded)
                with trainer.policy.adapter_off():
                    teacher = trainer.policy.logprobs(reminded)
            return float(((teacher - student) * unreminded.mask).sum() / unreminded.mask.sum())

        lora = {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters() if "lora_" in n}
        before = gap()
        metrics = trainer.train_step(rows)
        assert metrics is not None and metrics["memory_rows"] == 4 and metrics["samples"] == 4
        measured = memory_gap_means(metrics["memory_gaps"])[entry]
        assert measured["tokens"] == sum(len(s.token_ids) for s in steps)
        assert abs(measured["gap"] - before) < 1e-3  # the rows' own measure, taken before the step
        assert sorted(measured["steps"]) == sorted(by_id)
        for _ in range(3):
            trainer.train_step(rows)
        after = gap()
        assert abs(after) < abs(before) - 0.05, (before, after)
        assert any(not torch.equal(p, lora[n]) for n, p in trainer.policy.model.named_parameters() if n in lora)
        pool.ack(lease.lease_id)

    off = config_for(tiny_model_dir, tmp_path / "off", 'trainer.method="opd"', "trainer.batch_size=4",
                     "memory.distill_weight=0")
    with SQLitePool(tmp_path / "off", off.pool) as pool:
        trainer = Trainer(off, pool, resume=False)
        remembered_steps(pool, engine, generations, 4)
        rows = trainer.load(pool.lease(4, current_version=0))
        assert not any(r.memory for r in rows)
        assert trainer.train_step(rows)["tokens"] == 0  # nothing to learn from without the memory's rows


def test_an_entry_retires_once_learned_and_comes_back_when_forgotten(tiny_model_dir, tmp_path, engine,
                                                                      generations):
    """With the guard off, the trainer's measure on the served version decides: an entry the version
    says unreminded about as the reminded teacher does retires (it leaves the gateways' view of the
    user's memory); measured again on the steps it retired on, a version that forgot brings it
    back. With the guard on, the trainer's measure is recorded and the probes decide."""
    config = config_for(tiny_model_dir, tmp_path, 'trainer.method="opd"', "trainer.kl_coef=0",
                        "trainer.batch_size=4", "memory.retire_min_tokens=8", "guard.enabled=false")
    with SQLitePool(tmp_path, config.pool) as pool:
        trainer = Trainer(config, pool, resume=False)
        entry, steps = remembered_steps(pool, engine, generations, 4)
        changes = pool.memory_changes()
        assert [e["id"] for e in changes["entries"]] == [entry]
        gaps = {entry: {"gap_sum": 0.0, "tokens": 40.0, "steps": [s.step_id for s in steps]}}
        assert trainer.check_memory(gaps, 3) == {"retired": [entry], "restored": []}
        row = pool.memory_entry(entry)
        assert row["status"] == "retired"
        assert row["checks"] == [{"version": 3, "gap": 0.0, "tokens": 40, "source": "trained"}]
        later = pool.memory_changes(changes["entries_rev"], changes["switches_rev"])
        assert [(e["id"], e["status"]) for e in later["entries"]] == [(entry, "retired")]  # out of the prompts
        [due] = pool.memory_recheck()
        assert due["id"] == entry and due["steps"] == [s.step_id for s in steps][-memory.RECHECK_STEPS:]

        # The trainer's own measure of it, on the steps it retired on: the base teacher reminded
        # against the untrained policy unreminded, a real gap, over the return edge here.
        measured = consolidate.recheck(trainer.policy, pool, trainer.config, trainer.tc, None)[entry]
        assert measured["tokens"] == sum(len(s.token_ids) for s in steps[-memory.RECHECK_STEPS:])
        assert abs(measured["gap"]) > 0.01
        config.memory.return_gap = config.memory.retire_gap = min(abs(measured["gap"]) - 1e-3, 5.0)
        assert trainer.check_memory({}, 4) == {"retired": [], "restored": [entry]}
        assert pool.memory_entry(entry)["status"] == "active"
        checks = pool.memory_entry(entry)["checks"]
        assert [e["version"] for e in checks] == [3, 0]  # (v0 served: no guard here)
        assert memory.learned(checks) == f"v3 +0.00, v0 {checks[1]['gap']:+.2f}"  # the dashboard's column

        # Too few tokens never retires, however small the gap.
        few = {entry: {"gap_sum": 0.0, "tokens": 4.0, "steps": ["m1"]}}
        assert trainer.check_memory(few, 5)["retired"] == []
        # The guard on: the same small gap on enough tokens is recorded, and retires nothing.
        config.guard.enabled = True
        assert trainer.check_memory(gaps, 6) == {"retired": [], "restored": []}
        assert pool.memory_entry(entry)["status"] == "active"
        assert pool.memory_entry(entry)["checks"][-1] == {"version": 6, "gap": 0.0, "tokens": 40, "source": "trained"}


def test_a_new_correction_replaces_a_retired_entry_on_its_topic(open_test_pool):
    """A user who corrects again what a retired entry said: the weights did not hold it, and the new
    wording is the one that serves (the retired entry is `replaced`, never active beside it). The
    pool's measure and recheck on each backend."""
    from tests.unit.test_datapool import make_step

    pool = open_test_pool()
    pool.append_steps([replace(make_step(f"a-{t}", "s1", t), memory={"user": "user:ann"}) for t in range(2)])
    pool.add_feedback(session_id="s1", turn_index=0, correction="No lists please.")
    [first] = pool.memory()
    measured = {first["id"]: {"gap": 0.01, "tokens": 100, "steps": ["a-0"]}}
    assert pool.check_memory(2, measured, 0.05, 0.15, 64) == {"retired": [first["id"]], "restored": []}
    assert pool.memory_recheck("default") == [{"id": first["id"], "user_id": "user:ann", "steps": ["a-0"]}]
    assert pool.memory_recheck("acme") == []
    kept = {first["id"]: {"gap": 0.1, "tokens": 100, "steps": []}}  # between the edges: stays retired
    assert pool.check_memory(3, kept, 0.05, 0.15, 64) == {"retired": [], "restored": []}
    assert [c["gap"] for c in pool.memory_entry(first["id"])["checks"]] == [0.01, 0.1]
    pool.add_feedback(session_id="s1", turn_index=1, correction="Please, no numbered lists.")
    entries = {e["id"]: e for e in pool.memory()}
    assert entries[first["id"]]["status"] == "replaced"
    assert [e["status"] for e in entries.values() if e["id"] != first["id"]] == ["active"]
