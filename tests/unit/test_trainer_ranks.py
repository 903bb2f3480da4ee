"""Data-parallel training on CPU with gloo: two ranks (`clawr1 train --nproc 2`, real processes)
publish the adapter one process publishes from the same batch; a rank killed while the group holds
a lease loses nothing, and the samples are trained once after the restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from clawr1.datapool import SQLitePool
from clawr1.engine import adapters
from clawr1.trainer.history import read_metrics
from clawr1.trainer.loop import Trainer
from clawr1.trainer.policy import ADAPTER
from clawr1.trainer.ranks import Ranks
from tests.gateway_helpers import wait_for
from tests.unit.test_trainer import config_for, fill

SETTINGS = ('trainer.method="combine"', "trainer.batch_size=6", "trainer.min_samples=0", "trainer.micro_batch=2",
            "trainer.kl_coef=0.1", "pool.lease_seconds=4")


def train_command(tiny_model_dir, data_dir, nproc: int, *extra: str) -> list[str]:
    sets = [f'data_dir="{data_dir}"', f'engine.model="{tiny_model_dir}"', "trainer.max_wait_s=0",
            "trainer.lr=0.01", "guard.enabled=false", *SETTINGS, *extra]
    return [sys.executable, "-m", "clawr1.cli.main", "train", "--nproc", str(nproc),
            *[arg for s in sets for arg in ("--set", s)]]


def published(data_dir, version: int, full: bool = False) -> dict[str, torch.Tensor]:
    """Version `version`'s tensors once published: the LoRA adapter, or (`full`) the whole weights."""
    path = adapters.version_dir(data_dir / ("weights" if full else "adapters"), ADAPTER, version)
    wait_for(lambda: (path / adapters.MARKER).is_file(), timeout=180, what=f"v{version} under {data_dir}")
    return load_file(path / ("model.safetensors" if full else "adapter_model.safetensors"))


def two_ranks_publish(tiny_model_dir, data_dir, version: int, *extra: str) -> dict[str, torch.Tensor]:
    """`clawr1 train --nproc 2` until it publishes `version`; then stopped, and it must exit cleanly."""
    proc = subprocess.Popen(train_command(tiny_model_dir, data_dir, 2, *extra), stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "CLAWR1_DATA_DIR": ""})
    try:
        got = published(data_dir, version, full='trainer.finetune="full"' in extra)
    finally:
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 0, err[-3000:]
    return got


def test_share_splits_by_tokens_and_every_sample_goes_to_one_rank():
    lengths = [100, 10, 60, 50, 40, 5]
    shares = [Ranks(r, 2).share(lengths) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(6))
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(lengths)  # balanced to within one sample
    assert Ranks().share(lengths) == list(range(6))


def test_two_gloo_ranks_publish_the_single_process_adapter(tiny_model_dir, tmp_path, generations):
    one, two = tmp_path / "one", tmp_path / "two"
    for data_dir in (one, two):
        with SQLitePool(data_dir, config_for(tiny_model_dir, data_dir).pool) as pool:
            fill(pool, generations[:6])  # rewards +1/-1 and a hint every third: RL and OPD terms
    config = config_for(tiny_model_dir, one, *SETTINGS)
    with SQLitePool(one, config.pool) as pool:
        metrics = Trainer(config, pool).run_once()
        assert metrics is not None and metrics["samples"] == 6
    got = two_ranks_publish(tiny_model_dir, two, 1)
    want = published(one, 1)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.allclose(got[name], tensor, atol=1e-5), name
    assert any(float(t.abs().max()) > 0 for n, t in want.items() if "lora_B" in n)  # it trained
    with SQLitePool(two) as pool:
        assert pool.stats()["consumed"] == 6
    [row] = read_metrics(two)
    assert row["ranks"] == 2 and row["samples"] == 6  # both ranks' counts, summed


def test_a_killed_rank_loses_nothing_and_trains_nothing_twice(tiny_model_dir, tmp_path, generations):
    """The group leases 6 samples and accumulates their gradients (a version waits for 8, or half
    the 10 s lease); rank 1 dies meanwhile. Nothing was acknowledged, so the lease expires and
    the samples return; the restarted trainer trains them into exactly one version."""
    accumulate = ("trainer.min_samples=8", "trainer.batch_size=8", "pool.lease_seconds=10")
    proc = subprocess.Popen(train_command(tiny_model_dir, tmp_path, 2, *accumulate), stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "CLAWR1_DATA_DIR": ""})
    try:
        ranks = wait_for(lambda: _ranks(proc.pid), timeout=60, what="two trainer ranks")
        with SQLitePool(tmp_path, config_for(tiny_model_dir, tmp_path).pool) as pool:
            fill(pool, generations[:6])
            wait_for(lambda: pool.stats().get("leased", 0) == 6, timeout=60, what="the group to lease the 6")
            os.kill(ranks[1], signal.SIGKILL)  # mid-version: gradients accumulated, nothing stepped or acked
            proc.wait(timeout=120)
            assert pool.stats().get("consumed", 0) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, "the launcher reports the broken group"
    assert adapters.latest(tmp_path / "adapters", ADAPTER) is None
    restart = subprocess.Popen(train_command(tiny_model_dir, tmp_path, 1, "trainer.batch_size=6"),
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "CLAWR1_DATA_DIR": ""})
    try:
        with SQLitePool(tmp_path) as pool:
            wait_for(lambda: pool.stats().get("consumed", 0) == 6, timeout=120, what="the 6 samples trained")
    finally:
        restart.send_signal(signal.SIGTERM)
        restart.communicate(timeout=120)
    assert adapters.latest(tmp_path / "adapters", ADAPTER)[0] == 1  # one version: trained once


def _ranks(pid: int) -> list[int] | None:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    return children if len(children) == 2 else None



def test_full_finetuning_shards_layers_over_two_ranks_and_checkpoints_interchange(tiny_model_dir, tmp_path,
                                                                                  generations):
    """Full fine-tuning on two gloo ranks (FSDP2): resumed from a one-process checkpoint, the
    sharded group trains v2 to the weights one process trains, rank 0 holds half the decoder
    layers, and its checkpoint (gathered) is the one-process checkpoint, optimizer moments too.
    Five samples a version, one a pass: the ranks run unequal numbers of passes (3 and 2, or 4
    and 1), so the one with fewer must pad with empty passes or the collectives hang."""
    full = ('trainer.finetune="full"', "trainer.lr=1e-3", "trainer.batch_size=5", "trainer.micro_batch=1")
    one, two = tmp_path / "one", tmp_path / "two"
    for data_dir in (one, two):
        with SQLitePool(data_dir, config_for(tiny_model_dir, data_dir).pool) as pool:
            fill(pool, generations[:10])
    with SQLitePool(one, config_for(tiny_model_dir, one).pool) as pool:
        trainer = Trainer(config_for(tiny_model_dir, one, *SETTINGS, *full), pool)
        assert [trainer.run_once()["version"] for _ in range(2)] == [1, 2]
        layer_bytes = sum(p.nbytes for p in trainer.policy.causal_lm.get_decoder().layers.parameters())
    with SQLitePool(two, config_for(tiny_model_dir, two).pool) as pool:
        assert Trainer(config_for(tiny_model_dir, two, *SETTINGS, *full), pool).run_once()["version"] == 1
    got = two_ranks_publish(tiny_model_dir, two, 2, *full)
    want = published(one, 2, full=True)
    assert set(got) == set(want)
    assert any(not torch.equal(want[n], published(one, 1, full=True)[n]) for n in want)  # v2 moved the weights
    for name, tensor in want.items():
        assert torch.allclose(got[name], tensor, atol=1e-5), name
    rows = {r["version"]: r for r in read_metrics(two)}
    [single] = [r for r in read_metrics(one) if r["version"] == 2]
    assert rows[2]["ranks"] == 2
    assert single["param_bytes"] - rows[2]["param_bytes"] == pytest.approx(layer_bytes / 2, rel=0.02)
    for name in ("trainable.safetensors",):
        a, b = (load_file(d / "trainer" / "checkpoint" / name) for d in (one, two))
        assert set(a) == set(b) and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    moments = [torch.load(d / "trainer" / "checkpoint" / "optimizer.pt", weights_only=False)["optimizer"]["state"]
               for d in (one, two)]
    assert set(moments[0]) == set(moments[1])
    for index, state in moments[0].items():
        assert torch.allclose(state["exp_avg_sq"], moments[1][index]["exp_avg_sq"], atol=1e-7, rtol=1e-4)
