"""Checkpoints that resume exactly: LoRA weights, optimizer state, RNG states and counters, written
to a temporary directory and renamed into place, so a crash leaves the previous one whole.

Reading one runs no code from the trainer's folder: the tensors are safetensors, and the optimizer
file is unpickled with `weights_only=True` (tensors and plain data only), onto the CPU whatever
device saved it (a state saved on `cuda:1` loads where one GPU is visible; `load_state_dict` then
moves the moments to their parameters' device). With several ranks, rank 0 alone reads and sends
what it read to the others (ranks on other hosts need not share its disk).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from clawr1.trainer import sharded
from clawr1.trainer.policy import Policy

WEIGHTS = "trainable.safetensors"  # the LoRA matrices, or every weight under full fine-tuning


def path_of(data_dir: Path, tenant: str | None = None) -> Path:
    return state_dir(data_dir, tenant) / "checkpoint"


def state_dir(data_dir: Path, tenant: str | None = None) -> Path:
    """The trainer's own files (checkpoint, metrics, W&B): per tenant with per-tenant adapters."""
    root = Path(data_dir) / "trainer"
    return root if tenant is None else root / "tenants" / tenant


def exists(data_dir: Path, tenant: str | None = None) -> bool:
    path = path_of(data_dir, tenant)
    return (path / "state.json").is_file() or (path.with_name(path.name + ".old") / "state.json").is_file()


def save(path: Path, policy: Policy, optimizer: torch.optim.Optimizer, state: dict[str, Any],
         whole: tuple[dict[str, torch.Tensor], dict] | None = None) -> None:
    """`whole`: the weights and optimizer state gathered from sharded ranks (`sharded.gather`),
    written in place of this process's own (the same format either way)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors, optimizer_state = whole if whole is not None else (policy.named_state(), optimizer.state_dict())
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp / WEIGHTS)
    torch.save({"optimizer": optimizer_state, "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate()}, tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps(state))
    for file in tmp.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    install(tmp, path)


def install(complete: Path, path: Path) -> None:
    """Make the complete checkpoint directory `complete` the one at `path` (moved, not copied); a
    crash at any point leaves `path` or its `.old` twin whole."""
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    complete.rename(path)  # the switch
    shutil.rmtree(old, ignore_errors=True)


def load(path: Path, policy: Policy, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """Restore in place; returns the saved state, or None when there is no checkpoint. With
    several ranks, a collective in which rank 0 reads and the others receive: sharded ranks
    (FSDP2) through `_load_sharded`, replicated ones (LoRA) through one broadcast of what it read."""
    found = _existing(Path(path))
    if sharded.is_sharded(policy.model):
        return _load_sharded(found, policy, optimizer)
    if dist.is_initialized() and dist.get_world_size() > 1:
        lead = dist.get_rank() == 0
        box = [(json.loads((found / "state.json").read_text()), *_read(found, policy))
               if lead and found is not None else None]
        dist.broadcast_object_list(box, src=0)  # (LoRA-sized: the weights and two moments)
        if box[0] is None:
            return None
        state, weights, saved = box[0]
    elif found is None:
        return None
    else:
        state, (weights, saved) = json.loads((found / "state.json").read_text()), _read(found, policy)
    params = policy.named_state()
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["torch_rng"])
    random.setstate(saved["python_rng"])
    return state


def _existing(path: Path) -> Path | None:
    """The checkpoint directory, or its `.old` twin after a crash between the two renames."""
    for candidate in (path, path.with_name(path.name + ".old")):
        if (candidate / "state.json").is_file():
            return candidate
    return None


def _read(path: Path, policy: Policy) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The checkpoint's tensors (checked against the policy's names) and its optimizer file (the
    optimizer's state and the RNG states), on the CPU; nothing in them runs."""
    weights = load_file(path / WEIGHTS if (path / WEIGHTS).is_file() else path / "lora.safetensors")  # older name
    missing = set(policy.named_state()) ^ set(weights)
    if missing:
        raise RuntimeError(f"checkpoint {path} does not match the LoRA config (differs in {sorted(missing)[:3]})")
    saved = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    return weights, saved


def _load_sharded(found: Path | None, policy: Policy, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """Rank 0 decides whether there is a checkpoint and reads it (the other ranks may not share its
    disk: Ray actors on other hosts); its state goes to every rank, and its tensors reach each
    rank's shards through FSDP's broadcast from rank 0."""
    lead = dist.get_rank() == 0
    box = [json.loads((found / "state.json").read_text()) if lead and found is not None else None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return None
    weights, optim = ({}, {})
    if lead:
        assert found is not None
        weights, saved = _read(found, policy)
        optim = saved["optimizer"]
        torch.set_rng_state(saved["torch_rng"])
        random.setstate(saved["python_rng"])
    sharded.scatter(policy.model, optimizer, weights, optim)
    return box[0]
