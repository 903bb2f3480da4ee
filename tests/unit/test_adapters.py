"""LoRA adapters: publication with a marker, load/unload, atomic swaps under load, mixed batches."""

import asyncio

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from clawr1.core.types import AdapterError, SamplingParams, UnknownAdapterError
from clawr1.engine import adapters as store
from tests.conftest import run


def make_adapter(tiny_model_dir, root, version, seed):
    """Publish a LoRA adapter with random non-zero weights as `policy` v`version`."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, config, adapter_name="policy")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return store.publish(model, root, "policy", version)


def test_publish_is_marked_last_and_latest_finds_it(tiny_model_dir, tmp_path):
    path = make_adapter(tiny_model_dir, tmp_path, 3, seed=0)
    assert store.read_marker(path) == {"name": "policy", "version": 3, "rollback": None}
    assert {"STABLE", "adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in path.iterdir()}
    make_adapter(tiny_model_dir, tmp_path, 7, seed=1)
    (tmp_path / "policy" / "v000009").mkdir()  # a crashed write: no marker
    assert store.latest(tmp_path, "policy")[0] == 7
    with pytest.raises(AdapterError):
        make_adapter(tiny_model_dir, tmp_path, 7, seed=2)


def test_load_changes_logprobs_and_unload_restores_exactly(fresh_engine, tiny_model_dir, tmp_path):
    engine = fresh_engine
    ids = engine.render([{"role": "user", "content": "Hello"}])
    completion = engine.tokenizer("Hello there, friend.")["input_ids"]
    base = run(engine.score(ids, completion))
    path = make_adapter(tiny_model_dir, tmp_path, 1, seed=0)
    assert run(engine.load_adapter("policy", path)) == 1
    assert engine.adapters() == {"policy": 1}
    tuned = run(engine.score(ids, completion, adapter="policy"))
    assert max(abs(a - b) for a, b in zip(base, tuned)) > 1e-2
    # The base model stays available beside the adapter (the judge uses it), in the same batch too.
    assert run(engine.score(ids, completion)) == base

    async def generate():
        return await engine.generate(ids, SamplingParams(max_tokens=5, temperature=0), adapter="policy").final()

    gen = run(generate())
    assert gen.version == 1 and gen.adapter == "policy"
    assert max(abs(a - b) for a, b in zip(gen.logprobs, run(engine.score(ids, gen.token_ids, adapter="policy")))) <= 1e-3
    run(engine.unload_adapter("policy"))
    assert engine.adapters() == {}
    assert run(engine.score(ids, completion)) == base
    with pytest.raises(UnknownAdapterError):
        run(engine.score(ids, completion, adapter="policy"))


def test_incomplete_adapter_directory_is_refused(fresh_engine, tiny_model_dir, tmp_path):
    path = make_adapter(tiny_model_dir, tmp_path, 1, seed=0)
    (path / store.MARKER).unlink()
    with pytest.raises(AdapterError, match="incomplete"):
        run(fresh_engine.load_adapter("policy", path))
    assert fresh_engine.adapters() == {}


def test_swap_during_8_concurrent_generations(fresh_engine, tiny_model_dir, tmp_path):
    engine = fresh_engine
    v1 = make_adapter(tiny_model_dir, tmp_path, 1, seed=0)
    v2 = make_adapter(tiny_model_dir, tmp_path, 2, seed=1)
    run(engine.load_adapter("policy", v1))

    async def go():
        prompts = [engine.render([{"role": "user", "content": f"Question {i}"}]) for i in range(8)]
        early = [engine.generate(p, SamplingParams(max_tokens=40, temperature=1.0, seed=i), adapter="policy")
                 for i, p in enumerate(prompts)]
        first = [await anext(aiter(s)) for s in early]  # every early request is running on v1
        swap = asyncio.create_task(engine.load_adapter("policy", v2))
        await swap
        late = [engine.generate(p, SamplingParams(max_tokens=10, temperature=1.0, seed=i), adapter="policy")
                for i, p in enumerate(prompts)]
        gens = await asyncio.gather(*[s.final() for s in early + late])
        return first, gens, prompts

    first, gens, prompts = run(go())
    assert len(first) == 8
    assert all(g.finish_reason in ("stop", "length") for g in gens)
    assert [g.version for g in gens] == [1] * 8 + [2] * 8
    assert engine.adapters() == {"policy": 2}
    # Each early request's logprobs are those of v1 throughout: the swap did not leak into it.
    run(engine.load_adapter("policy", v1))
    for prompt, gen in zip(prompts, gens[:8]):
        scored = run(engine.score(prompt, gen.token_ids, adapter="policy"))
        assert max(abs(a - b) for a, b in zip(gen.logprobs, scored)) <= 1e-3


def test_slot_reuse_never_touches_a_version_in_use(fresh_engine, tiny_model_dir, tmp_path):
    """v2 and v3 arrive while requests still run on v1: v1's slot is never overwritten while held,
    and once free, later versions are copied into spare slots instead of being injected anew."""
    engine = fresh_engine
    versions = {v: make_adapter(tiny_model_dir, tmp_path, v, seed=v) for v in (1, 2, 3)}
    run(engine.load_adapter("policy", versions[1]))

    async def go():
        prompts = [engine.render([{"role": "user", "content": f"Tell me about {i}"}]) for i in range(4)]
        streams = [engine.generate(p, SamplingParams(max_tokens=60, temperature=1.0, seed=i), adapter="policy")
                   for i, p in enumerate(prompts)]
        for s in streams:
            await anext(aiter(s))
        await engine.load_adapter("policy", versions[2])
        await engine.load_adapter("policy", versions[3])
        return prompts, await asyncio.gather(*[s.final() for s in streams])

    prompts, gens = run(go())
    assert [g.version for g in gens] == [1] * 4
    assert engine._slots._count == 3  # v1 held, v2 live while v3 loads: three slots needed
    run(engine.load_adapter("policy", versions[1]))  # now copied into a spare slot
    for prompt, gen in zip(prompts, gens):
        scored = run(engine.score(prompt, gen.token_ids, adapter="policy"))
        assert max(abs(a - b) for a, b in zip(gen.logprobs, scored)) <= 1e-3
    run(engine.load_adapter("policy", versions[2]))
    assert engine._slots._count == 3  # no new injection: every later version was a copy


def test_what_serves_after_a_restart_is_pinned_else_newest_promoted_never_rejected(tiny_model_dir, tmp_path):
    """`to_serve`, the one restart rule of the gateway's guard and of a restarted Ray replica."""
    for version in (1, 2, 3):
        make_adapter(tiny_model_dir, tmp_path, version, seed=version)
    assert store.to_serve(tmp_path, "policy") == 0  # nothing decided: the base, not the newest
    store.decide(tmp_path, "policy", 1, "promoted", "test", {})
    store.decide(tmp_path, "policy", 2, "promoted", "test", {})
    store.decide(tmp_path, "policy", 3, "rejected", "test", {})
    assert store.to_serve(tmp_path, "policy") == 2
    store.set_control(tmp_path, "policy", pinned=0)  # a pin to the base is a pin too
    assert store.to_serve(tmp_path, "policy") == 0
    store.set_control(tmp_path, "policy", pinned=3)
    assert store.to_serve(tmp_path, "policy") == 3


def test_a_restarted_engine_replica_loads_what_serves_not_a_rejected_candidate(tiny_model_dir, tmp_path):
    from clawr1.cluster.actors import EngineReplica
    from clawr1.core.config import load_config

    root = tmp_path / "adapters"
    make_adapter(tiny_model_dir, root, 1, seed=1)
    store.decide(root, "policy", 1, "promoted", "test", {})
    make_adapter(tiny_model_dir, root, 2, seed=2)
    store.decide(root, "policy", 2, "rejected", "test", {})
    config = load_config(None, [f'data_dir="{tmp_path}"', f'engine.model="{tiny_model_dir}"', "engine.threads=1"])
    replica = EngineReplica(config, 0)
    try:
        assert run(replica.ready())["policy"] == 1
    finally:
        run(replica.engine.close())


def test_two_writers_of_control_never_tear_it_or_undo_each_other(tmp_path):
    """The guard (a rollback), the dashboard and `clawr1 pin` each change one field of `CONTROL`:
    a reader never sees a torn file, no writer fails, and neither change undoes the other."""
    import threading
    import time

    errors: list[str] = []
    last = {"pin": 0, "rollback": 0}
    stop = threading.Event()

    def write(kind: str) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                if kind == "pin":
                    store.set_control(tmp_path, "policy", pinned=i)
                else:
                    store.set_control(tmp_path, "policy", rollback={"to": 1, "id": f"r{i}"})
                last[kind] = i
            except (OSError, ValueError) as exc:  # what torn writes raised before each writer had its own file
                errors.append(f"{kind}: {exc!r}")

    def read() -> None:
        while not stop.is_set():
            try:
                store.control(tmp_path, "policy")
            except ValueError as exc:  # a torn file is not JSON
                errors.append(f"read: {exc!r}")

    threads = [threading.Thread(target=write, args=("pin",)), threading.Thread(target=write, args=("rollback",)),
               threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    time.sleep(1.5)
    stop.set()
    for thread in threads:
        thread.join()
    assert errors == []
    assert last["pin"] > 10 and last["rollback"] > 10
    assert store.control(tmp_path, "policy") == {"pinned": last["pin"], "rollback": {"to": 1, "id": f"r{last['rollback']}"}}
