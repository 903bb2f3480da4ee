"""The Ray deployment's client-side pieces without a cluster: `RayPool` over a stand-in actor handle
(what the gateway's event loop may and may not wait for) and the router's replica watcher (what it
logs while a restarted replica is not ready). The whole deployment on a real local Ray: test_ray.py."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

from clawr1.cluster.pool import RayPool
from clawr1.cluster.router import RouterEngine
from clawr1.core.config import EngineConfig
from clawr1.core.records import Reward, Step
from tests.conftest import run


class Ref:
    """An ObjectRef stand-in: `.future()` is the concurrent future the actor's answer resolves."""

    def __init__(self) -> None:
        self.answer: Future = Future()

    def future(self) -> Future:
        return self.answer


class Method:
    def __init__(self, calls: list[tuple], name: str) -> None:
        self.calls, self.name = calls, name

    def remote(self, *args) -> Ref:
        ref = Ref()
        self.calls.append((self.name, args, ref))
        return ref


class PoolActor:
    """The pool service's handle, answering nothing until the test says so."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.append_step, self.call = Method(self.calls, "append_step"), Method(self.calls, "call")


def step(step_id: str) -> Step:
    return Step(step_id=step_id, tenant="default", session_id="s", prompt_id="s", turn_index=0, turn_type="main",
                messages=[{"role": "user", "content": "hi"}], tools=None, prompt_ids=[1], token_ids=[2],
                logprobs=[-0.5], text="ok", policy_version=0, adapter=None, finish_reason="stop", temperature=1.0)


def test_ray_pool_writes_return_before_the_actor_answers_and_pending_writes_is_local():
    actor = PoolActor()
    pool = RayPool(actor)
    submitted = threading.Event()

    def submit() -> None:  # in a thread: were a submit to wait for the actor, this would never finish
        futures.extend([pool.submit_step(step("a")), pool.submit_step(step("b")),
                        pool.submit_reward(Reward(step_id="a", score=1.0, source="judge"))])
        submitted.set()

    futures: list[Future] = []
    threading.Thread(target=submit, daemon=True).start()
    assert submitted.wait(5), "a submit waited for the actor"
    assert not any(f.done() for f in futures)
    assert pool.pending_writes() == 3
    assert [name for name, _, _ in actor.calls] == ["append_step", "append_step", "call"]  # no round trip to count
    for _, _, ref in actor.calls[:2]:
        ref.answer.set_result(True)
    actor.calls[2][2].answer.set_exception(KeyError("a"))  # a failed write is answered too
    assert [f.result() for f in futures[:2]] == [True, True] and pool.pending_writes() == 0


def test_ray_pool_reports_a_failed_step_write_until_one_succeeds_or_the_probe_passes(monkeypatch):
    """`write_error` is what the gateway's admission asks on every request: a Ray pool whose
    service cannot write must say so (503s), as a local pool does, with no round trip; the next
    stored step, or the half-open probe (`check_writable`, forwarded), clears it."""
    import sqlite3
    import sys
    import types

    actor = PoolActor()
    pool = RayPool(actor)
    assert pool.write_error() is None
    pool.submit_step(step("a"))
    actor.calls[-1][2].answer.set_exception(sqlite3.OperationalError("database or disk is full"))
    assert pool.write_error() == "OperationalError: database or disk is full"
    assert [name for name, _, _ in actor.calls] == ["append_step"]  # asking made no call
    pool.submit_step(step("b"))
    actor.calls[-1][2].answer.set_result(True)
    assert pool.write_error() is None
    pool.submit_step(step("c"))
    actor.calls[-1][2].answer.set_exception(sqlite3.OperationalError("disk I/O error"))
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(get=lambda ref: ref.answer.result()))
    probe = threading.Timer(0.05, lambda: actor.calls[-1][2].answer.set_result(None))
    probe.start()
    assert pool.check_writable() is None and pool.write_error() is None
    assert actor.calls[-1][0] == "call" and actor.calls[-1][1][0] == "check_writable"


def test_the_watcher_logs_why_a_downed_replica_is_not_back_yet(tiny_model_dir, caplog):
    class Replica:
        """Restarting for one round, then back but unable to load the served adapter once."""

        def __init__(self) -> None:
            self.asked = self.loads = 0
            self.ready, self.load_adapter = self, Loader(self)

        async def remote(self):  # ready()
            self.asked += 1
            if self.asked == 1:
                raise ConnectionError("replica restarting")
            return {"policy": 1, "weights": 0}

    class Loader:
        def __init__(self, replica: Replica) -> None:
            self.replica = replica

        async def remote(self, name: str, path: str) -> int:
            self.replica.loads += 1
            if self.replica.loads == 1:
                raise OSError(f"cannot read {path}")
            return 2

    replica = Replica()
    router = RouterEngine(tiny_model_dir, EngineConfig(), [replica])
    router._versions, router._paths, router.up = {"policy": 2}, {"policy": Path("/adapters/policy/v2")}, [False]

    async def go() -> None:
        with caplog.at_level(logging.DEBUG, logger="clawr1.cluster.router"):
            await asyncio.wait_for(router._watch(), timeout=20)

    run(go())
    assert router.up == [True] and replica.loads == 2
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert (logging.DEBUG, "engine replica 0 is not back yet: ConnectionError('replica restarting')") in messages
    assert any(level == logging.WARNING and "could not load the current versions" in text
               and "cannot read /adapters/policy/v2" in text for level, text in messages)


@pytest.mark.parametrize("backend", ["local", "vllm", "sglang", "tinker"])
def test_the_router_scores_at_temperature_one_only_where_its_replicas_do(tiny_model_dir, backend):
    """The guard samples its probes at temperature 1 where the engine says it scores only there
    (`scores_at_temperature_one_only`, read off the engine). The router did not say it, so a Ray
    deployment whose replicas are vLLM sampled probes at 0.7, which the replicas refuse to score
    at. Its replicas are `load_engine` of the same engine config: the router says what their class says."""
    import importlib

    module, name = {"local": ("clawr1.engine.local", "LocalEngine"), "vllm": ("clawr1.engine.vllm", "VLLMEngine"),
                    "sglang": ("clawr1.engine.sglang", "SGLangEngine"),
                    "tinker": ("clawr1.engine.tinker", "TinkerEngine")}[backend]
    replica_class = getattr(importlib.import_module(module), name)
    router = RouterEngine(tiny_model_dir, EngineConfig(backend=backend, url="http://127.0.0.1:9"), [])
    expected = getattr(replica_class, "scores_at_temperature_one_only", False)
    assert expected is (backend != "local")  # the servers' prompt logprobs are unscaled; the local engine scales
    assert getattr(router, "scores_at_temperature_one_only", False) is expected


class FakeRay:
    """`ray` as `launch.trainer_group` uses it: records each actor's options; answers at once."""

    def __init__(self, gpus: float) -> None:
        self.gpus, self.options = gpus, []

    def cluster_resources(self) -> dict[str, float]:
        return {"CPU": 16.0, **({"GPU": self.gpus} if self.gpus else {})}

    def remote(self, cls):
        fake = self

        class Handle:
            def __getattr__(self, name):
                return Method([], name)

        class Actor:
            @staticmethod
            def options(**options):
                fake.options.append(options)
                return type("Bound", (), {"remote": staticmethod(lambda *args: Handle())})

        return Actor

    @staticmethod
    def get(refs):
        return [1 for _ in refs] if isinstance(refs, list) else ("127.0.0.1", 1234)


@pytest.mark.parametrize("overrides, gpus, want", [
    ([], 8, {"num_gpus": 1.0}),  # auto on a GPU cluster: a GPU of its own for each rank
    (['trainer.device="cuda"'], 8, {"num_gpus": 1.0}),
    (["ray.trainer_gpus=2"], 8, {"num_gpus": 2.0}),
    ([], 0, {"num_gpus": 0, "runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}}),
    (['trainer.device="cpu"', "ray.trainer_gpus=0"], 8, {"num_gpus": 0,
                                                        "runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}}),
])
def test_each_trainer_rank_actor_asks_ray_for_its_own_gpu(monkeypatch, overrides, gpus, want):
    """Ray 2.60 leaves every GPU visible to an actor that asked for none (`num_gpus=0`, the old
    default of `ray.trainer_gpus`): each rank took cuda:0, beside engine replica 0, and NCCL failed
    on the duplicate GPU. Each rank asks for a GPU when the trainer runs on one, and one that asks
    for none sees none."""
    import sys

    from clawr1.cluster import launch
    from clawr1.core.config import load_config

    fake = FakeRay(gpus)
    monkeypatch.setitem(sys.modules, "ray", fake)
    config = load_config(None, ["ray.trainer_ranks=2", *overrides])
    assert len(launch.trainer_group(config, pool=None, generation=0)) == 2
    assert len(fake.options) == 2
    for options in fake.options:
        assert {k: options[k] for k in want} == want and options.get("runtime_env") == want.get("runtime_env")
    one = load_config(None, overrides)  # the single trainer actor asks the same
    assert launch.trainer_resources(one, gpus) == want


def test_gpus_that_cannot_give_each_trainer_rank_its_own_are_refused():
    from clawr1.cluster import launch
    from clawr1.core.config import load_config

    with pytest.raises(ValueError, match="ray.trainer_gpus = 0"):
        launch.trainer_resources(load_config(None, ['trainer.device="cuda"', "ray.trainer_gpus=0"]), 8)
    with pytest.raises(ValueError, match="NCCL refuses"):
        launch.trainer_resources(load_config(None, ["ray.trainer_ranks=2", "ray.trainer_gpus=0.5"]), 8)
    # one trainer may share a GPU with the engine replicas
    assert launch.trainer_resources(load_config(None, ["ray.trainer_gpus=0.5"]), 1) == {"num_gpus": 0.5}
