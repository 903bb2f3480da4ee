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


def save(path: Path, policy: Policy, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in policy.named_state().items()}, tmp / WEIGHTS)
    torch.save({"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
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
    """Restore in place; returns the saved state, or None when there is no checkpoint."""
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
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    saved = torch.load(path / "optimizer.pt", weights_only=False)
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["torch_rng"])
    random.setstate(saved["python_rng"])
    return json.loads((path / "state.json").read_text())
