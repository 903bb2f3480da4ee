"""The guard between the trainer and the users, on the tiny engine over real HTTP: held-out probes
come from traffic and leave training; a candidate identical in behaviour to the base is promoted
and served; a wildly drifted one is rejected and never served; verdicts, the decision log, pins and
rollbacks are visible; and the trainer undoes a rejected version exactly."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from clawr1.core.config import EngineConfig, load_config
from clawr1.datapool import SQLitePool
from clawr1.engine import adapters as store
from clawr1.engine.local import LocalEngine
from tests.conftest import run
from tests.gateway_helpers import live_gateway, wait_for

GUARD = ("guard.probes=8", "guard.probe_max_tokens=8", "gateway.adapter_poll_s=0.1")


def publish(tiny_model_dir, root, version: int, scale: float, rollback: str | None = None):
    """A LoRA version: B = 0 (scale 0) behaves exactly as the base; a large scale wrecks the model.
    `rollback`: the newest rollback its trainer had applied."""
    torch.manual_seed(version)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                                      init_lora_weights=False), adapter_name="policy")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 1.0).mul_(scale)
    return store.publish(model, root / "adapters", "policy", version, rollback=rollback)


def store_rewarded(pool, pairs, offset: int, score) -> None:
    """Real sampled replies (`generations` pairs) as READY samples: step g-i, rewarded `score(i)`."""
    from clawr1.core.records import Reward, Step

    for i, (messages, gen) in enumerate(pairs, start=offset):
        pool.append_step(Step(step_id=f"g-{i}", tenant="default", session_id=f"s{i}", prompt_id=f"s{i}",
                              turn_index=0, turn_type="main", messages=messages, tools=None,
                              prompt_ids=gen.prompt_ids, token_ids=gen.token_ids, logprobs=gen.logprobs,
                              text=gen.text, policy_version=0, adapter=None, finish_reason=gen.finish_reason,
                              temperature=gen.temperature))
        pool.add_reward(Reward(step_id=f"g-{i}", score=score(i), source="test"))


@pytest.fixture
def fresh(tiny_model_dir):
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, max_batch=8))
    yield engine
    run(engine.close())


def talk(base: str, n: int) -> None:
    for i in range(n):
        body = {"model": "m", "max_tokens": 6, "messages": [{"role": "user", "content": f"Question {i}: how do I cook rice?"}]}
        assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).status_code == 200


def fingerprint(base: str) -> str:
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "who answers?"}]}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()["system_fingerprint"]


def test_the_guard_promotes_a_sane_version_and_never_serves_a_broken_one(fresh, tiny_model_dir, tmp_path):
    with live_gateway(fresh, tmp_path, *GUARD) as (base, pool):
        talk(base, 10)  # traffic to hold probes out of
        publish(tiny_model_dir, tmp_path, 1, scale=0.0)
        verdict = wait_for(lambda: store.verdict(tmp_path / "adapters", "policy", 1), 120, "a verdict on v1")
        assert verdict["status"] == "promoted", verdict
        assert verdict["scores"]["candidate"]["sane_rate"] >= verdict["scores"]["base"]["sane_rate"] - 0.1
        wait_for(lambda: fingerprint(base) == "clawr1-v1", 10, "v1 served")

        publish(tiny_model_dir, tmp_path, 2, scale=30.0)
        verdict = wait_for(lambda: store.verdict(tmp_path / "adapters", "policy", 2), 120, "a verdict on v2")
        assert verdict["status"] == "rejected" and "KL" in verdict["reason"], verdict
        assert verdict["scores"]["candidate"]["kl"] > 1.0
        assert fingerprint(base) == "clawr1-v1"  # the rejected version never served a request
        assert "policy@candidate" not in fresh.adapters()

        # Probes are held out of training and their replies are side turns anyone can read; half
        # of the 8 are everyday requests (`guard.everyday_probes`), prompts no user sent.
        probes = [s for s in pool.samples(limit=100) if s["reason"] == "probe"]
        assert len(probes) == 4 and all(s["status"] == "dropped" for s in probes)
        assert verdict["scores"]["from_traffic"] == 4 and verdict["scores"]["probes"] == 8
        sessions = {s["session_id"] for s in pool.sessions(limit=100)}
        assert {"probe:base:set1", "probe:policy@candidate:v1", "probe:policy@candidate:v2"} <= sessions
        log = [(d["version"], d["status"]) for d in pool.policy_versions("policy")]
        assert log == [(1, "promoted"), (2, "rejected")]
        # The dashboard shows each verdict beside the version's numbers, and /metrics counts them.
        rows = {r["version"]: r for r in httpx.get(f"{base}/dashboard/api/summary").json()["versions"]}
        assert rows[1]["probe_status"] == "promoted" and rows[2]["probe_status"] == "rejected"
        assert rows[2]["probe_kl"] > 1.0 and rows[1]["probe_sane_rate"] is not None
        page = httpx.get(f"{base}/metrics").text
        assert 'clawr1_guard_decisions_total{decision="rejected"} 1.0' in page
        assert 'clawr1_guard_rejected_in_a_row{adapter="policy"} 1.0' in page  # since v1's promotion
        assert 'clawr1_served_quality{adapter="policy",measure="sane_rate",who="served"}' in page

        # The admin's levers: pin the base, then roll back.
        store.set_control(tmp_path / "adapters", "policy", pinned=0)
        wait_for(lambda: fingerprint(base) == "clawr1-v0", 10, "the pinned base served")
        store.set_control(tmp_path / "adapters", "policy", pinned=None)
        wait_for(lambda: fingerprint(base) == "clawr1-v1", 10, "the newest promoted served again")
        store.set_control(tmp_path / "adapters", "policy", rollback={"to": 0, "id": "r1"})
        wait_for(lambda: fingerprint(base) == "clawr1-v0", 10, "rolled back to the base")
        assert store.verdict(tmp_path / "adapters", "policy", 1)["status"] == "superseded"
        statuses = [d["status"] for d in pool.policy_versions("policy")]
        assert statuses[-3:] == ["pinned", "unpinned", "rolled_back"]
        # The dashboard's buttons pull the same levers (open here: no keys, loopback only).
        answer = httpx.post(f"{base}/dashboard/versions", data={"action": "pin", "version": "1"})
        assert answer.status_code == 303 and store.control(tmp_path / "adapters", "policy")["pinned"] == 1
        assert httpx.post(f"{base}/dashboard/versions", data={"action": "pin", "version": "9"}).status_code == 404
        assert httpx.post(f"{base}/dashboard/versions", data={"action": "drop", "version": "1"}).status_code == 400
        # The admin may roll back to a rejected version: it then counts as promoted, so a restart serves it.
        store.set_control(tmp_path / "adapters", "policy", pinned=None)
        wait_for(lambda: fingerprint(base) == "clawr1-v0", 10, "unpinned: the base (v1 was superseded)")
        store.set_control(tmp_path / "adapters", "policy", rollback={"to": 2, "id": "r2"})
        wait_for(lambda: fingerprint(base) == "clawr1-v2", 10, "rolled back to the rejected v2")
        assert store.verdict(tmp_path / "adapters", "policy", 2)["status"] == "promoted"
        assert store.to_serve(tmp_path / "adapters", "policy") == 2


def test_a_served_version_found_out_of_the_base_range_is_rolled_back(fresh, tiny_model_dir, tmp_path):
    """Drift that passed every candidate's check can leave the served version itself out of the
    base's range (the demo's v24: held-out sane 0.54 against the base's 0.92). When the next
    candidate is rejected and the served version fails against the base on the same probes, the
    guard rolls back (as an admin would) to the newest earlier promoted version in range, here the
    base, and the trainer restores it through the same CONTROL."""
    root = tmp_path / "adapters"
    publish(tiny_model_dir, tmp_path, 1, scale=0.0)
    store.decide(root, "policy", 1, "promoted", "test: in range", {})
    publish(tiny_model_dir, tmp_path, 2, scale=30.0)  # wrecked, yet served: as if promoted on too few probes
    store.decide(root, "policy", 2, "promoted", "test: drifted past the probes", {})
    # Probes from the traffic alone: on the tiny random model every reply to an everyday request is
    # as far from it as a wrecked version's, so those probes would blur the served-vs-base check.
    with live_gateway(fresh, tmp_path, *GUARD, "guard.everyday_probes=0") as (base, pool):
        wait_for(lambda: fingerprint(base) == "clawr1-v2", 10, "the drifted v2 served after the restart")
        talk(base, 10)
        publish(tiny_model_dir, tmp_path, 3, scale=30.0)
        verdict = wait_for(lambda: store.verdict(root, "policy", 3), 120, "a verdict on v3")
        assert verdict["status"] == "rejected" and "the served v2 itself is worse" in verdict["reason"], verdict
        assert "rolling back to v1" in verdict["reason"]  # v1 was asked the same probes and is in range
        wait_for(lambda: fingerprint(base) == "clawr1-v1", 10, "v1 served again")
        assert verdict["scores"]["incumbent_version"] == 2
        control = store.control(root, "policy")["rollback"]
        assert control["to"] == 1 and control["by"] == "guard"
        assert store.verdict(root, "policy", 2)["status"] == "superseded"
        assert ("policy", 1, "rolled_back") in [(d["adapter"], d["version"], d["status"])
                                                for d in pool.policy_versions("policy")]


def test_the_trainer_undoes_a_rejected_version_and_keeps_a_promoted_one(tiny_model_dir, tmp_path, generations):
    from clawr1.trainer.loop import Trainer

    def store_samples(pool, pairs, offset: int) -> None:
        store_rewarded(pool, pairs, offset, lambda i: 1.0 if i % 2 == 0 else -1.0)

    config = load_config(None, [f'data_dir="{tmp_path}"', f'engine.model="{tiny_model_dir}"', "trainer.batch_size=4",
                                "trainer.lr=0.05", "trainer.poll_s=0.02", "guard.decision_timeout_s=30"])
    pool = SQLitePool(tmp_path, config.pool)
    trainer = Trainer(config, pool)
    root = tmp_path / "adapters"

    def judge(version: int, status: str) -> None:  # the guard's part, from another thread
        wait_for(lambda: store.newest(root, "policy") and store.newest(root, "policy")[0] == version, 30)
        store.decide(root, "policy", version, status, "test", {})

    before = {k: v.clone() for k, v in trainer.policy.named_trainable().items()}
    store_samples(pool, generations[:4], 0)
    threading.Thread(target=judge, args=(1, "rejected"), daemon=True).start()
    metrics = trainer.run_once()
    assert metrics["verdict"] == "rejected" and trainer.version == 1 and trainer.promoted == 0
    after = trainer.policy.named_trainable()
    assert all(torch.equal(before[k], after[k]) for k in before)  # exactly the incumbent again

    store_samples(pool, generations[4:8], 4)
    threading.Thread(target=judge, args=(2, "promoted"), daemon=True).start()
    metrics = trainer.run_once()
    assert metrics["verdict"] == "promoted" and trainer.promoted == 2
    moved = trainer.policy.named_trainable()
    assert any(not torch.equal(before[k], moved[k]) for k in before)
    trainer.close()
    resumed = Trainer(config, pool)  # the promoted state is what a restart resumes
    assert resumed.promoted == 2 and all(torch.equal(moved[k], v) for k, v in resumed.policy.named_trainable().items())
    resumed.close()
    pool.close()


def test_a_version_promoted_after_the_trainer_stopped_waiting_is_what_a_rejection_goes_back_to(
        tiny_model_dir, tmp_path, generations):
    """v1's verdict comes after the trainer stopped waiting (undecided: it trains on from v1). The
    guard then promotes v1, which serves; when v2 is rejected the trainer goes back to v1's state
    (kept when its verdict did not come), not to the base's, and a restart counts v1 as the incumbent."""
    from clawr1.trainer import guarded
    from clawr1.trainer.loop import Trainer

    config = load_config(None, [f'data_dir="{tmp_path}"', f'engine.model="{tiny_model_dir}"', "trainer.batch_size=4",
                                "trainer.lr=0.05", "trainer.poll_s=0.02", "guard.decision_timeout_s=0.1"])
    root = tmp_path / "adapters"
    with SQLitePool(tmp_path, config.pool) as pool:
        trainer = Trainer(config, pool)
        store_rewarded(pool, generations[:4], 0, lambda i: 1.0 if i % 2 == 0 else -1.0)
        metrics = trainer.run_once()
        assert metrics["verdict"] == "undecided" and (trainer.weights_of, trainer.promoted) == (1, 0)
        v1 = {k: v.clone() for k, v in trainer.policy.named_trainable().items()}
        store.decide(root, "policy", 1, "promoted", "late", {})
        trainer.config.guard.decision_timeout_s = 30.0  # v2's verdict is waited for (a loaded machine's judge thread is slow)

        store_rewarded(pool, generations[4:8], 4, lambda i: 1.0 if i % 2 else -1.0)

        def reject_v2() -> None:
            wait_for(lambda: store.newest(root, "policy") and store.newest(root, "policy")[0] == 2, 30)
            store.decide(root, "policy", 2, "rejected", "test", {})

        threading.Thread(target=reject_v2, daemon=True).start()
        metrics = trainer.run_once()
        assert metrics["verdict"] == "rejected" and (trainer.weights_of, trainer.promoted) == (1, 1)
        assert all(torch.equal(v1[k], v) for k, v in trainer.policy.named_trainable().items())
        assert not (guarded.candidate_path(tmp_path, None, 1)).exists()  # installed as the incumbent's
        trainer.close()
        resumed = Trainer(config, pool)
        assert (resumed.version, resumed.weights_of, resumed.promoted) == (2, 1, 1)
        resumed.close()


def test_late_verdicts_install_the_newest_promoted_candidate_and_drop_the_decided(tmp_path):
    from clawr1.trainer import guarded

    root = tmp_path / "adapters"
    for version in range(1, 6):  # published v1..v5, each with its state kept as a candidate
        store.version_dir(root, "policy", version).mkdir(parents=True)
        guarded.candidate_path(tmp_path, None, version).mkdir(parents=True)
        (guarded.candidate_path(tmp_path, None, version) / "state.json").write_text(f'{{"version": {version}}}')
    for version, status in ((1, "promoted"), (2, "promoted"), (3, "rejected")):
        store.decide(root, "policy", version, status, "late", {})
    assert guarded.adopt_late(tmp_path, None, root, "policy", promoted=0, keep=1) == 2
    assert json.loads((guarded.promoted_path(tmp_path, None) / "state.json").read_text()) == {"version": 2}
    # v1 is below the new incumbent, v3 decided, v4 beyond `keep`: only the newest undecided is kept
    assert sorted(p.name for p in guarded.candidates_dir(tmp_path, None).iterdir()) == ["v5"]
    assert guarded.adopt_late(tmp_path, None, root, "policy", promoted=2, keep=1) is None


def test_rejections_in_a_row_do_not_make_the_incumbents_samples_stale(tiny_model_dir, tmp_path, generations):
    """After a rejected candidate the trainer holds the incumbent's weights again, so the samples
    the incumbent serves are on-policy: staleness counts from the weights held, not from the newest
    version number. (Counted from the number, three rejections with a bound of 1 dropped every
    sample the served v0 produced, and the trainer starved: seen in a demo run.)"""
    from clawr1.trainer.loop import Trainer

    config = load_config(None, [f'data_dir="{tmp_path}"', f'engine.model="{tiny_model_dir}"', "trainer.batch_size=2",
                                "trainer.min_samples=2", "trainer.lr=0.05", "trainer.poll_s=0.02",
                                "pool.max_staleness=1", "guard.decision_timeout_s=30"])
    root = tmp_path / "adapters"
    with SQLitePool(tmp_path, config.pool) as pool:
        trainer = Trainer(config, pool)
        for version in (1, 2, 3, 4):
            # served by the incumbent, v0
            store_rewarded(pool, generations[2 * version:2 * version + 2], 2 * version, lambda i: 1.0 if i % 2 else -1.0)

            def judge(v: int = version) -> None:
                wait_for(lambda: store.newest(root, "policy") and store.newest(root, "policy")[0] == v, 30)
                store.decide(root, "policy", v, "rejected", "test", {})

            threading.Thread(target=judge, daemon=True).start()
            metrics = wait_for(trainer.run_once, 30, f"version {version}")
            assert metrics["verdict"] == "rejected" and metrics["lease"] == 2 and metrics["staleness"] == 0
        assert trainer.version == 4 and trainer.promoted == 0 and trainer.weights_of == 0
        assert pool.stats()["dropped"] == 0
        trainer.close()


def test_a_stop_does_not_wait_for_the_verdict_and_the_next_life_applies_it(tiny_model_dir, tmp_path, generations):
    """Stopping (`clawr1 up` shut down) while the trainer waits for the guard leaves the version
    undecided at once instead of holding the shutdown for the guard's probes; rejected while the
    trainer was down, the next trainer starts from the incumbent's weights, not the rejected ones."""
    from clawr1.trainer.loop import Trainer

    config = load_config(None, [f'data_dir="{tmp_path}"', f'engine.model="{tiny_model_dir}"', "trainer.batch_size=4",
                                "trainer.lr=0.05", "trainer.poll_s=0.02", "guard.decision_timeout_s=600"])
    root = tmp_path / "adapters"
    with SQLitePool(tmp_path, config.pool) as pool:
        store_rewarded(pool, generations[:4], 0, lambda i: 1.0 if i % 2 == 0 else -1.0)
        trainer = Trainer(config, pool)
        before = {k: v.clone() for k, v in trainer.policy.named_trainable().items()}
        stop = threading.Event()

        def stop_once_published() -> None:
            wait_for(lambda: store.newest(root, "policy"), 30, "v1 published")
            stop.set()

        threading.Thread(target=stop_once_published, daemon=True).start()
        metrics = trainer.run_once(stop)  # would wait up to 600 s for a verdict without the stop
        assert metrics["verdict"] == "undecided" and trainer.weights_of == 1 and trainer.promoted == 0
        trainer.close()

        store.decide(root, "policy", 1, "rejected", "test", {})  # the guard decides while no trainer runs
        resumed = Trainer(config, pool)
        assert (resumed.version, resumed.weights_of, resumed.promoted) == (1, 0, 0)
        assert all(torch.equal(before[k], v) for k, v in resumed.policy.named_trainable().items())
        resumed.close()


def test_with_the_guard_off_every_version_serves_as_published_and_the_admins_levers_still_work(
        fresh, tiny_model_dir, tmp_path):
    """`guard.enabled = false`: no probes and no quality model, each new version is promoted as
    published and served at once; yet `clawr1 rollback` and `clawr1 pin` act as with the guard
    on, and a version that does not load is rejected once (not retried, never served)."""
    root = tmp_path / "adapters"
    off = ("guard.enabled=false", "gateway.adapter_poll_s=0.1")
    with live_gateway(fresh, tmp_path, *off) as (base, pool):
        publish(tiny_model_dir, tmp_path, 1, scale=30.0)  # wrecked: the guard off serves it anyway
        wait_for(lambda: fingerprint(base) == "clawr1-v1", 20, "v1 served as published")
        publish(tiny_model_dir, tmp_path, 2, scale=0.0)
        wait_for(lambda: fingerprint(base) == "clawr1-v2", 20, "v2 served as published")
        assert store.verdict(root, "policy", 2)["reason"] == "served as published (guard.enabled = false)"

        store.set_control(root, "policy", rollback={"to": 1, "id": "r1"})
        wait_for(lambda: fingerprint(base) == "clawr1-v1", 10, "rolled back to v1")
        assert store.verdict(root, "policy", 2)["status"] == "superseded"
        store.set_control(root, "policy", pinned=0)
        wait_for(lambda: fingerprint(base) == "clawr1-v0", 10, "the pinned base served")
        store.set_control(root, "policy", pinned=None)
        wait_for(lambda: fingerprint(base) == "clawr1-v1", 10, "the newest promoted served again (v2 superseded)")

        broken = store.version_dir(root, "policy", 3)  # marked, but its weights are not a LoRA
        broken.mkdir(parents=True)
        (broken / "adapter_config.json").write_text("{}")
        (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
        store.write_json(broken / store.MARKER, {"name": "policy", "version": 3})
        store.write_json(root / "policy" / store.LATEST, {"version": 3})
        verdict = wait_for(lambda: store.verdict(root, "policy", 3), 10, "a verdict on the broken v3")
        assert verdict["status"] == "rejected" and verdict["reason"].startswith("did not load"), verdict
        assert fingerprint(base) == "clawr1-v1"
        # A version the trainer published mid-step, before it applied rollback r1: the discarded line.
        publish(tiny_model_dir, tmp_path, 4, scale=0.0, rollback=None)
        verdict = wait_for(lambda: store.verdict(root, "policy", 4), 10, "a verdict on v4")
        assert verdict["status"] == "rejected" and "trained before the rollback to v1" in verdict["reason"]
        publish(tiny_model_dir, tmp_path, 5, scale=0.0, rollback="r1")  # trained on from v1
        wait_for(lambda: fingerprint(base) == "clawr1-v5", 20, "the next version of the kept line served")
        statuses = [(d["version"], d["status"]) for d in pool.policy_versions("policy")]
        assert statuses == [(1, "promoted"), (2, "promoted"), (1, "rolled_back"), (0, "pinned"), (1, "unpinned"),
                            (3, "rejected"), (4, "rejected"), (5, "promoted")], statuses
        page = httpx.get(f"{base}/metrics").text
        assert 'clawr1_guard_decisions_total{decision="promoted"} 3.0' in page
        assert httpx.get(f"{base}/dashboard/api/summary").json()["guard"] is None  # no probe settings to show
    assert "policy@candidate" not in fresh.adapters()


def test_a_restart_applies_a_rollback_asked_while_down_and_serves_what_loads(fresh, tiny_model_dir, tmp_path):
    """What serves after a restart: a rollback the admin asked while no gateway ran takes effect
    (the discarded line's promoted versions are superseded, the target serves); a promoted
    version that no longer loads is rejected and the next one in line serves, and the guard goes
    on serving new versions."""
    root = tmp_path / "adapters"
    off = ("guard.enabled=false", "gateway.adapter_poll_s=0.1")
    with live_gateway(fresh, tmp_path, *off) as (base, _):
        publish(tiny_model_dir, tmp_path, 1, scale=0.0)
        wait_for(lambda: fingerprint(base) == "clawr1-v1", 20, "v1 served")
        publish(tiny_model_dir, tmp_path, 2, scale=0.0)
        wait_for(lambda: fingerprint(base) == "clawr1-v2", 20, "v2 served")
    store.set_control(root, "policy", rollback={"to": 1, "id": "r9"})  # while no gateway runs
    with live_gateway(fresh, tmp_path, *off) as (base, _):
        wait_for(lambda: store.verdict(root, "policy", 2)["status"] == "superseded", 20, "the rollback applied")
        wait_for(lambda: fingerprint(base) == "clawr1-v1", 20, "the rollback's target served")
        assert store.to_serve(root, "policy") == 1
    (store.version_dir(root, "policy", 1) / "adapter_model.safetensors").write_bytes(b"not safetensors")
    restarted = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, max_batch=8))  # a new process's
    try:
        with live_gateway(restarted, tmp_path, *off) as (base, pool):
            wait_for(lambda: store.verdict(root, "policy", 1)["reason"].startswith("did not load"), 20,
                     "the restore to find that v1 does not load")
            assert fingerprint(base) == "clawr1-v0"  # v2 was superseded: the base serves
            publish(tiny_model_dir, tmp_path, 3, scale=0.0, rollback="r9")  # the guard's loop still runs
            wait_for(lambda: fingerprint(base) == "clawr1-v3", 20, "v3 served after the failed restore")
            assert [(d["version"], d["status"]) for d in pool.policy_versions("policy")][-2:] == [
                (1, "rejected"), (3, "promoted")]
    finally:
        run(restarted.close())


def test_a_poll_that_fails_does_not_end_the_guard(tmp_path, caplog):
    """One poll that raises something other than an engine error (here a `CONTROL` that is not JSON)
    is logged and the next poll runs: an ended guard would serve its version with no swap, rollback
    or pin until a restart."""
    import asyncio
    import types

    from clawr1.core.config import Config
    from clawr1.guard import Guard

    config = Config(data_dir=str(tmp_path))
    config.gateway.adapter_poll_s = 0.02
    gw = types.SimpleNamespace(config=config, per_tenant=False, engine=types.SimpleNamespace(adapters=dict),
                               pool=None, swaps=[])
    (tmp_path / "adapters" / "policy").mkdir(parents=True)
    (tmp_path / "adapters" / "policy" / "CONTROL").write_text("{")

    async def poll_a_while() -> bool:
        guard = asyncio.ensure_future(Guard(gw).run())
        await asyncio.sleep(0.3)
        alive = not guard.done()
        guard.cancel()
        return alive

    assert asyncio.run(poll_a_while())
    assert sum("this poll failed" in r.getMessage() for r in caplog.records) >= 3  # each poll, again


def test_retention_spares_the_version_that_serves_though_the_trainer_missed_its_verdict(tmp_path):
    """A verdict that came after the trainer stopped waiting: v1 serves (promoted), the trainer
    still counts v0 as its incumbent; pruning down to one version must not delete v1."""
    from clawr1.trainer import guarded

    for version in (1, 2, 3):
        folder = store.version_dir(tmp_path, "policy", version)
        folder.mkdir(parents=True)
        store.write_json(folder / store.MARKER, {"name": "policy", "version": version})
    store.decide(tmp_path, "policy", 1, "promoted", "late", {})
    store.decide(tmp_path, "policy", 2, "rejected", "worse", {})
    keep = guarded.protected(tmp_path, "policy", promoted=0)
    assert 1 in keep
    store.prune(tmp_path, "policy", 1, keep)
    assert 1 in store.published(tmp_path, "policy") and store.to_serve(tmp_path, "policy") == 1


def test_probes_need_a_user_message_and_are_sampled_at_temperature_one_on_a_server(tmp_path, monkeypatch):
    """A held-out turn with no user message is no probe (relevance is measured against the user's
    request: it failed the whole draw); a vLLM or SGLang server scores at temperature 1 only, so
    there the probes are sampled at 1 (at 0.7 no probe set was ever calibrated, no verdict given)."""
    import asyncio
    import types

    from clawr1.core.config import Config
    from clawr1.core.records import Step
    from clawr1.guard import Guard
    from clawr1.guard import guard as module
    from clawr1.guard.probes import probes_of

    def step(step_id, messages):
        return Step(step_id=step_id, tenant="default", session_id="s", prompt_id="p", turn_index=0, turn_type="main",
                    messages=messages, tools=None, prompt_ids=[1, 2], token_ids=[3], logprobs=[-1.0], text="x",
                    policy_version=0, adapter=None, finish_reason="stop", temperature=0.7, top_p=0.8, top_k=20)

    held = probes_of([step("a", [{"role": "system", "content": "You are an agent."}]),
                      step("b", [{"role": "user", "content": "hi"}])], 16)
    assert [p.step_id for p in held] == ["b"]

    sampled: list[tuple[float, float, int]] = []
    seeds: list[int] = []

    async def ask(engine, pool, probes, adapter, tenant, label):
        sampled.extend((p.temperature, p.top_p, p.top_k) for p in probes)
        seeds.extend(p.seed for p in probes)
        return []

    class Meter:
        async def calibrate(self, replies):
            return "calibration", []

    async def meter():
        return Meter()

    monkeypatch.setattr(module, "ask", ask)
    monkeypatch.setattr(module, "replies_of", lambda probes, gens, engine: [])
    async def measure(meter, probes, gens, calibration):
        return types.SimpleNamespace(sane_rate=1.0)

    monkeypatch.setattr(module, "measure", measure)
    # A server scores at temperature 1, uncut; the local engine as the turn was sampled.
    for engine, expected in ((types.SimpleNamespace(scores_at_temperature_one_only=True), (1.0, 1.0, 0)),
                             (types.SimpleNamespace(), (0.7, 0.8, 20))):
        sampled.clear()
        seeds.clear()
        gw = types.SimpleNamespace(config=Config(data_dir=str(tmp_path)), per_tenant=False, engine=engine, pool=None,
                                   swaps=[], quality_meter=meter)
        guard = Guard(gw)
        drawn = asyncio.run(guard._draw(guard._line("policy"), held, 1))
        assert sampled == [expected, expected] and [(p.temperature, p.top_p, p.top_k) for p in drawn.probes] == [expected]
        # The base answers twice: the calibration's replies, then its reference ones with other seeds.
        # Every version then answers with the reference's seeds.
        assert seeds == [held[0].seed, held[0].seed + module.REFERENCE_SEED] and drawn.probes[0].seed == seeds[1]


def test_the_kl_bound_holds_when_a_probe_reply_is_empty_and_an_unmeasured_kl_does_not_pass():
    """One empty probe reply (no tokens, so no KL) made the candidate's KL None, and the guard then
    dropped its `max_kl` check: any drift passed. The KL is now the mean over the replies with
    tokens, bounded as before; with no reply measured at all the bound is not waved through."""
    from clawr1.quality import Calibration, Quality, Summary, summarize

    config = load_config(None, ["guard.max_kl=0.5"]).guard
    cal = Calibration(0.3, -2.0, 0.25, 16, 0.6, -1.4, 0.0)
    drifted = [Quality(0.7, -1.0, 0.0, False, 10, kl=2.0, entropy=1.0) for _ in range(7)]
    empty = Quality(0.0, None, 0.0, True, 0)
    candidate = summarize(drifted + [empty], cal)
    assert candidate.kl == pytest.approx(2.0) and candidate.entropy == pytest.approx(1.0)
    from clawr1.guard.guard import verdicts
    reference = Summary(n=8, relevance=0.7, fluency=-1.0, repetition=0.0, sane_rate=candidate.sane_rate, kl=0.0)
    against_incumbent, against_base = verdicts(candidate, reference, reference, config)
    assert not against_incumbent.ok and "KL 2.000 nats/token (max 0.500)" in against_incumbent.reason
    assert against_base.ok
    unmeasured = summarize([empty] * 8, cal)
    assert unmeasured.kl is None
    against_incumbent, _ = verdicts(unmeasured, replace_sane(reference, unmeasured), reference, config)
    assert not against_incumbent.ok and "KL not measured" in against_incumbent.reason
    calm = summarize([Quality(0.7, -1.0, 0.0, False, 10, kl=0.1, entropy=1.0)] * 7 + [empty], cal)
    assert verdicts(calm, reference, reference, config)[0].ok  # within the bound: passes


def replace_sane(summary, like):
    from dataclasses import replace

    return replace(summary, sane_rate=like.sane_rate)


def test_rejections_in_a_row_shrink_the_next_step_until_a_promotion(tiny_model_dir, tmp_path, generations):
    """From the base, each rejection restored the initial LoRA and an empty AdamW, so every next
    candidate was the same first (warm-up) step, which moves every weight by the same lr whatever
    the batch: a guard that rejected it once rejected every candidate. Each rejection in a row now
    halves the next step (`trainer.reject_backoff`); a promotion ends the backoff."""
    from safetensors.torch import load_file

    from clawr1.trainer.loop import Trainer

    config = load_config(None, [f'data_dir="{tmp_path}"', f'engine.model="{tiny_model_dir}"', "trainer.batch_size=2",
                                "trainer.lr=0.05", "trainer.poll_s=0.02", "guard.decision_timeout_s=30"])
    root = tmp_path / "adapters"
    with SQLitePool(tmp_path, config.pool) as pool:
        trainer = Trainer(config, pool)
        moves, lrs = [], []
        for version, status in ((1, "rejected"), (2, "rejected"), (3, "promoted"), (4, "rejected")):
            store_rewarded(pool, generations[2 * version:2 * version + 2], 2 * version,
                           lambda i: 1.0 if i % 2 else -1.0)

            def judge(v: int = version, s: str = status) -> None:
                wait_for(lambda: store.newest(root, "policy") and store.newest(root, "policy")[0] == v, 30)
                store.decide(root, "policy", v, s, "test", {})

            threading.Thread(target=judge, daemon=True).start()
            metrics = trainer.run_once()
            assert metrics["verdict"] == status
            lrs.append(metrics["lr"])
            published = load_file(store.version_dir(root, "policy", version) / "adapter_model.safetensors")
            moves.append(max(float(t.abs().max()) for n, t in published.items() if "lora_B" in n))
        # v1..v3 are each one first Adam step from the base (B = 0): each moves B by about its lr
        assert lrs[0] == pytest.approx(0.05 / 4) and lrs[1] == pytest.approx(lrs[0] / 2)
        assert lrs[2] == pytest.approx(lrs[0] / 4) and lrs[3] == pytest.approx(2 * 0.05 / 4)  # after a promotion: off
        assert moves[1] == pytest.approx(moves[0] / 2, rel=0.02) and moves[2] == pytest.approx(moves[0] / 4, rel=0.02)
        assert trainer.rejections == 1 and trainer.promoted == 3
        trainer.close()
        resumed = Trainer(config, pool)  # the count is checkpointed: a restart keeps the smaller step
        assert resumed.rejections == 1
        resumed.close()


def test_a_probe_is_asked_without_the_users_memory():
    """A held-out turn whose prompt carried a user's memory is replayed as its client sent it: the
    guard measures what a version says unreminded, and no user's entries reach a probe (the
    everyday probes take their system prompt from the held ones)."""
    from clawr1.core import memory
    from clawr1.core.records import Step
    from clawr1.guard.probes import probes_of

    sent = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "hi"}]
    served, added, at = memory.add_to(sent, memory.block(["No lists, please."]))
    step = Step(step_id="a", tenant="default", session_id="s", prompt_id="p", turn_index=0, turn_type="main",
                messages=served, tools=None, prompt_ids=[1, 2, 3], token_ids=[3], logprobs=[-1.0], text="x",
                policy_version=0, adapter=None, finish_reason="stop", temperature=0.7,
                memory=memory.record("user:ann", [(1, "No lists, please.")], added, at))
    rendered = []

    def render(messages, tools):
        rendered.append(messages)
        return [7, 8]

    [probe] = probes_of([step], 16, render)
    assert probe.messages == sent and probe.prompt_ids == [7, 8] and rendered == [sent]
    assert probe.memory_ids == (1,) and probe.reminded_ids == [1, 2, 3]  # kept to measure the reminder
    [plain] = probes_of([Step(**{**step.__dict__, "memory": {"user": "user:ann"}, "messages": sent})], 16, render)
    assert plain.prompt_ids == [1, 2, 3] and plain.memory_ids == () and plain.reminded_ids is None
