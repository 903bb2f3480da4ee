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


# ---- ranks in processes of the test's own (`torch.multiprocessing`), each running a few lines ------
def spawn_ranks(fn, *args) -> None:
    """`fn(rank, *args)` as two gloo ranks, each in a process of its own (joined into one group by
    `in_group`); a rank that raises fails the test with its traceback."""
    import torch.multiprocessing as mp

    from clawr1.trainer.ranks import free_port

    mp.spawn(fn, args=(free_port(), *args), nprocs=2, join=True)


def in_group(rank: int, port: int) -> Ranks:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    return Ranks.from_env("cpu")


FULL = ('trainer.finetune="full"', "trainer.lr=1e-3", "trainer.batch_size=5", "trainer.micro_batch=1")


def _sharded_step_with_foreach(rank: int, port: int, tiny_model_dir, data_dir, out) -> None:
    """One version on two sharded ranks, AdamW's `foreach` forced on (its default on CUDA); records
    whether every decoder layer had given its gathered weights back when the final norm ran."""
    from torch.distributed.tensor import DTensor

    ranks = in_group(rank, port)
    with SQLitePool(data_dir, config_for(tiny_model_dir, data_dir).pool) as pool:
        trainer = Trainer(config_for(tiny_model_dir, data_dir, *SETTINGS, *FULL), pool, ranks=ranks)
        trainer.optimizer = trainer.new_optimizer(foreach=True)
        decoder = trainer.policy.causal_lm.get_decoder()
        resharded = []
        decoder.norm.register_forward_pre_hook(lambda *_: resharded.append(
            all(isinstance(p, DTensor) for layer in decoder.layers for p in layer.parameters())))
        assert trainer.run_once()["version"] == 1
        trainer.close()
    torch.save(resharded, out / f"resharded-{rank}.pt")
    ranks.close()


def test_sharded_ranks_step_with_foreach_adamw_and_free_each_layer_after_its_forward(tiny_model_dir, tmp_path,
                                                                                    generations):
    """Under FSDP2 the decoder layers' weights are DTensors and the rest plain tensors: AdamW's
    `foreach` (CUDA's default) refused the mix ("mixed torch.Tensor and DTensor"). And each layer,
    an FSDP root, kept its gathered weights until its backward, so all were whole at once. Two
    gloo ranks with `foreach=True` take the step one process takes, and every layer is sharded
    again by the time the final norm runs."""
    one, two = tmp_path / "one", tmp_path / "two"
    for data_dir in (one, two):
        with SQLitePool(data_dir, config_for(tiny_model_dir, data_dir).pool) as pool:
            fill(pool, generations[:5])
    with SQLitePool(one, config_for(tiny_model_dir, one).pool) as pool:
        trainer = Trainer(config_for(tiny_model_dir, one, *SETTINGS, *FULL), pool)
        before = {n: p.detach().clone() for n, p in trainer.policy.named_trainable().items()}
        assert trainer.run_once()["version"] == 1
    spawn_ranks(_sharded_step_with_foreach, tiny_model_dir, two, tmp_path)
    got, want = published(two, 1, full=True), published(one, 1, full=True)
    assert set(got) == set(want) and set(before) <= set(want)
    for name, tensor in want.items():
        assert torch.allclose(got[name], tensor, atol=1e-5), name
    assert all(not torch.equal(want[n], before[n]) for n in before)  # every weight moved
    for rank in (0, 1):
        resharded = torch.load(tmp_path / f"resharded-{rank}.pt")
        assert resharded and all(resharded), resharded  # one pass a micro-batch (and empty passes): all sharded


def _resume_on_own_disks(rank: int, port: int, tiny_model_dir, data_dirs, out) -> None:
    """Rank r resumes with `data_dirs[r]` as its data dir (rank 1's is empty: another host without
    a shared disk), then goes back to the incumbent's state; records what it holds."""
    ranks = in_group(rank, port)
    data_dir = data_dirs[rank]
    config = config_for(tiny_model_dir, data_dir, "guard.enabled=true")
    with SQLitePool(data_dir, config.pool) as pool:
        trainer = Trainer(config, pool, ranks=ranks)
        resumed = {k: v.detach().clone() for k, v in trainer.policy.named_trainable().items()}
        counters = (trainer.step_count, trainer.version, trainer.promoted)
        with torch.no_grad():  # drift away, then back to the promoted state (a rejection's undo)
            for param in trainer.policy.parameters():
                param.add_(1.0)
        trainer.restore_promoted()
        restored = {k: v.detach().clone() for k, v in trainer.policy.named_trainable().items()}
        trainer.close()
    torch.save({"resumed": resumed, "restored": restored, "counters": counters}, out / f"held-{rank}.pt")
    ranks.close()


def test_lora_ranks_take_rank_0s_checkpoint_and_promoted_state_without_a_shared_disk(tiny_model_dir, tmp_path,
                                                                                      generations):
    """Only rank 0 writes the checkpoint and the promoted state, but every rank read them from its
    own disk: a rank on another host started from the initial LoRA at version 0 and silently
    trained a different model (and a rejection's undo raised there). Rank 0 reads; the others
    receive what it read."""
    lead, other = tmp_path / "lead", tmp_path / "other"
    config = config_for(tiny_model_dir, lead)
    with SQLitePool(lead, config.pool) as pool:
        fill(pool, generations[:6])
        trainer = Trainer(config, pool)
        assert [trainer.run_once()["version"] for _ in range(2)] == [1, 2]
        want = {k: v.detach().clone() for k, v in trainer.policy.named_trainable().items()}
        trainer.close()
    spawn_ranks(_resume_on_own_disks, tiny_model_dir, [lead, other], tmp_path)
    assert not (other / "trainer").exists()  # rank 1 wrote nothing: its disk stayed empty
    counters = []
    for rank in (0, 1):
        held = torch.load(tmp_path / f"held-{rank}.pt")
        counters.append(held["counters"])  # (step, version, promoted)
        assert held["counters"][:2] == (2, 2), rank
        for key in ("resumed", "restored"):
            assert set(held[key]) == set(want)
            assert all(torch.equal(held[key][n], want[n]) for n in want), (rank, key)
    assert counters[0] == counters[1]
