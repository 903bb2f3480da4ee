"""Checkpoints that resume exactly: LoRA weights, optimizer state, RNG states and counters, written
to a temporary directory and renamed into place, so a crash leaves the previous one whole."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
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
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)  # the switch; a crash before it leaves `path` or `.old` whole
    shutil.rmtree(old, ignore_errors=True)


def load(path: Path, policy: Policy, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """Restore in place; returns the saved state, or None when there is no checkpoint. Sharded
    ranks (FSDP2) each read the whole checkpoint and keep their shards: a collective."""
    path = Path(path)
    if not (path / "state.json").is_file():
        old = path.with_name(path.name + ".old")  # a crash between the two renames
        if not (old / "state.json").is_file():
            return None
        path = old
    weights = load_file(path / WEIGHTS if (path / WEIGHTS).is_file() else path / "lora.safetensors")  # older name
    params = policy.named_state()
    missing = set(params) ^ set(weights)
    if missing:
        raise RuntimeError(f"checkpoint {path} does not match the LoRA config (differs in {sorted(missing)[:3]})")
    saved = torch.load(path / "optimizer.pt", weights_only=False)
    if sharded.is_sharded(policy.model):
        sharded.scatter(policy.model, optimizer, weights, saved["optimizer"])
    else:
        with torch.no_grad():
            for name, value in weights.items():
                params[name].copy_(value)
        optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["torch_rng"])
    random.setstate(saved["python_rng"])
    return json.loads((path / "state.json").read_text())
