"""Tenants: each key belongs to one; with `adapter_per_tenant` each tenant's data trains its own
LoRA adapter, served to that tenant only. Tenants never see each other's sessions, samples,
adapters or dashboard rows. Real gateway, real pool, the real trainer, the tiny model."""

from __future__ import annotations

import httpx
import pytest
import torch

from clawr1.core.config import EngineConfig, load_config, to_toml
from clawr1.datapool import SQLitePool
from clawr1.engine import adapters
from clawr1.engine.local import LocalEngine
from clawr1.entrypoints.logs import secrets_of
from clawr1.trainer.tenants import TenantTrainers
from tests.conftest import run
from tests.gateway_helpers import live_gateway, steps_of, wait_for

ACME, GLOBEX, ADMIN = "sk-acme-0001", "sk-globex-0001", "admin-key-0123456789"
OVERRIDES = [f'tenants.keys={{acme = ["{ACME}"], globex = ["{GLOBEX}"]}}', "tenants.adapter_per_tenant=true",
             f'gateway.admin_key="{ADMIN}"', "gateway.adapter_poll_s=0.05", "trainer.batch_size=1",
             "trainer.max_wait_s=0", "trainer.lr=0.01", "guard.enabled=false"]  # test_guard.py: the guard
FIRST = [{"role": "user", "content": "Hello, who are you?"}]


def chat(base: str, key: str, messages: list[dict]) -> dict:
    response = httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                          json={"model": "m", "messages": messages, "max_tokens": 5, "temperature": 0})
    response.raise_for_status()
    return response.json()


def converse(base: str, key: str) -> dict:
    """Two turns of one stock conversation (no headers: history matching); returns the first reply."""
    first = chat(base, key, FIRST)
    chat(base, key, FIRST + [first["choices"][0]["message"], {"role": "user", "content": "No. Be brief."}])
    return first


def feedback(base: str, key: str, **body) -> httpx.Response:
    return httpx.post(f"{base}/v1/feedback", headers={"Authorization": f"Bearer {key}"}, timeout=30, json=body)


@pytest.fixture(scope="module")
def own_engine(tiny_model_dir):
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, max_batch=8))
    yield engine
    run(engine.close())


def test_each_tenant_trains_and_is_served_its_own_adapter_and_sees_only_its_own_data(own_engine, tiny_model_dir,
                                                                                      tmp_path):
    overrides = [f'engine.model="{tiny_model_dir}"', *OVERRIDES]
    with live_gateway(own_engine, tmp_path, *overrides) as (base, pool):
        a_first, _ = converse(base, ACME), converse(base, GLOBEX)  # the very same words, two tenants
        steps = steps_of(pool, 4)
        sessions = {s.tenant: s.session_id for s in steps}
        assert len({s.session_id for s in steps}) == 2 and set(sessions) == {"acme", "globex"}
        assert all(s.session_id == sessions[s.tenant] for s in steps)  # never matched across tenants

        # globex can neither reward nor even find acme's turns.
        assert feedback(base, GLOBEX, completion_id=a_first["id"], reward=1).status_code == 404
        assert feedback(base, GLOBEX, session_id=sessions["acme"], reward=1).status_code == 404
        assert feedback(base, ACME, session_id=sessions["acme"], turn_index=0, reward=-1,
                        correction="Say who you are in one line.").status_code == 200

        config = load_config(None, [f'data_dir="{tmp_path}"', *overrides])
        with SQLitePool(tmp_path, config.pool) as trainer_pool:
            trainers = TenantTrainers(config, trainer_pool)
            first = trainers.run_once()
            assert first["tenant"] == "acme" and first["version"] == 1 and trainers.run_once() is None
            leased = [r for r in pool.samples(limit=100) if r["lease_id"] == first["lease_id"]]
            assert leased and {r["tenant"] for r in leased} == {"acme"}  # acme's adapter saw only acme's data
            assert adapters.latest(tmp_path / "adapters", "policy-globex") is None

            wait_for(lambda: chat(base, ACME, FIRST)["system_fingerprint"] == "clawr1-v1", what="acme on its v1")
            assert chat(base, GLOBEX, FIRST)["system_fingerprint"] == "clawr1-v0"  # globex: still the base model
            recent = [s for s in pool.get_steps([r["step_id"] for r in pool.samples(limit=100)])
                      if s.policy_version == 1]
            assert recent and all(s.tenant == "acme" and s.adapter == "policy-acme" for s in recent)

            models = {key: [m["id"] for m in httpx.get(f"{base}/v1/models", headers={
                "Authorization": f"Bearer {key}"}).json()["data"]] for key in (ACME, GLOBEX)}
            assert "policy-acme" in models[ACME] and "policy-acme" not in models[GLOBEX]

            # globex liked the very reply acme corrected: the two adapters must learn opposite things.
            assert feedback(base, GLOBEX, session_id=sessions["globex"], turn_index=0, reward=1).status_code == 200
            second = trainers.run_once()
            assert second["tenant"] == "globex" and second["version"] == 1
            lora = {t: {n: p.detach().clone() for n, p in tr.policy.model.named_parameters() if f".{tr.adapter}." in n}
                    for t, tr in trainers.trainers.items()}
            trainers.close()
        assert len(trainers.trainers) == 2 and trainers.trainers["acme"].policy is trainers.trainers["globex"].policy
        a, b = lora["acme"], lora["globex"]
        assert a and len(a) == len(b)
        assert any(not torch.equal(x, y) for x, y in zip(a.values(), b.values(), strict=True))  # two adapters

        # The dashboard, scoped to a tenant, shows that tenant's rows and none of the other's.
        admin = {"Authorization": f"Bearer {ADMIN}"}
        scoped = httpx.get(f"{base}/dashboard/api/summary", params={"tenant": "globex"}, headers=admin).json()
        assert {s["tenant"] for s in scoped["sessions"]} == {"globex"} and {r["tenant"] for r in scoped["samples"]} == {"globex"}
        assert scoped["adapter"] == "policy-globex" and scoped["pool"]["main_steps"] < pool.stats()["main_steps"]
        page = httpx.get(f"{base}/dashboard", params={"tenant": "globex"}, headers=admin).text
        assert sessions["globex"] in page and sessions["acme"] not in page
        everyone = httpx.get(f"{base}/dashboard/api/summary", headers=admin).json()
        assert {s["tenant"] for s in everyone["sessions"]} == {"acme", "globex"}
        # Agent keys never open the dashboard, whichever tenant they belong to.
        assert httpx.get(f"{base}/dashboard/api/summary", headers={"Authorization": f"Bearer {ACME}"}).status_code == 401


def test_tenant_keys_are_validated_and_never_printed():
    config = load_config(None, OVERRIDES)
    assert ACME not in to_toml(config) and GLOBEX not in to_toml(config)
    assert set(secrets_of(config)) >= {ACME, GLOBEX, ADMIN}  # redacted from every log line
    with pytest.raises(ValueError, match="tenant name"):
        load_config(None, ['tenants.keys={"../evil" = ["sk-evil-0001"]}'])
    with pytest.raises(ValueError, match="unique"):
        load_config(None, [f'tenants.keys={{a = ["{ACME}"], b = ["{ACME}"]}}'])
