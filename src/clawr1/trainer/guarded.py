"""The trainer's side of the guard: wait for the verdict on each published version, roll back to the
incumbent when it is rejected, apply an admin's rollback, and prune old versions.

The incumbent's state (LoRA weights, AdamW moments, RNG, counters) is kept as a second checkpoint,
`trainer/promoted`, written whenever a version is promoted; at the very start it is the initial
LoRA (the base model, v0). A rejected version is then undone exactly: the policy and optimizer go
back to that checkpoint and the main checkpoint is rewritten, so a restart resumes from the
incumbent too. Version numbers keep increasing (the rejected one stays on disk with its verdict).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from clawr1.engine import adapters
from clawr1.trainer import checkpoint

log = logging.getLogger(__name__)


def promoted_path(data_dir: Path, tenant: str | None) -> Path:
    return checkpoint.state_dir(data_dir, tenant) / "promoted"


def candidates_dir(data_dir: Path, tenant: str | None) -> Path:
    return checkpoint.state_dir(data_dir, tenant) / "candidates"


def candidate_path(data_dir: Path, tenant: str | None, version: int) -> Path:
    """The state of a version whose verdict did not come while the trainer waited: should the
    guard promote it later, it becomes the incumbent's (`adopt_late`)."""
    return candidates_dir(data_dir, tenant) / f"v{version}"


def drop_candidates(data_dir: Path, tenant: str | None) -> None:
    """An admin's rollback supersedes every version after its target: none may become the incumbent."""
    shutil.rmtree(candidates_dir(data_dir, tenant), ignore_errors=True)


def adopt_late(data_dir: Path, tenant: str | None, root: Path, name: str, promoted: int, keep: int) -> int | None:
    """The newest kept candidate the guard promoted after the trainer stopped waiting, installed
    as the incumbent's checkpoint (what a rejection rolls back to); None when there is none. Drops
    the candidates decided or not above the incumbent, and all but the newest `keep`."""
    folder = candidates_dir(data_dir, tenant)
    if not folder.is_dir():
        return None
    kept = sorted((int(p.name[1:]), p) for p in folder.iterdir() if p.name[1:].isdigit())
    verdicts = {version: adapters.verdict(root, name, version) for version, _ in kept}
    late = [version for version, _ in kept
            if version > promoted and (verdicts[version] or {}).get("status") == "promoted"]
    adopted = max(late) if late else None
    for i, (version, path) in enumerate(kept):
        if version == adopted:
            checkpoint.install(path, promoted_path(data_dir, tenant))
            log.info("%s v%d was promoted after the trainer stopped waiting: it is the incumbent now", name, version)
        elif version <= max(promoted, adopted or 0) or verdicts[version] is not None or i < len(kept) - keep:
            shutil.rmtree(path)
    return adopted


def wait_for_verdict(root: Path, name: str, version: int, timeout_s: float, poll_s: float,
                     stop: Any = None) -> dict[str, Any] | None:
    """The guard's verdict on `version`, or None after `timeout_s` (no gateway is deciding)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        verdict = adapters.verdict(root, name, version)
        if verdict is not None:
            return verdict
        if stop is not None and stop.is_set():
            return None
        time.sleep(poll_s)
    log.warning("no verdict on %s v%d after %.0f s (is a gateway with the guard running?); training on",
                name, version, timeout_s)
    return None


def load_published(policy: Any, path: Path, adapter: str) -> None:
    """Copy a published LoRA version's weights into the trainer's adapter (an admin rollback to a
    version whose optimizer state is gone: the moments start afresh)."""
    from peft import set_peft_model_state_dict

    state = load_file(Path(path) / "adapter_model.safetensors")
    result = set_peft_model_state_dict(policy.model, state, adapter_name=adapter)
    unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if unexpected:
        raise RuntimeError(f"{path} does not fit the trainer's LoRA ({unexpected[:2]} ...)")


def zero_adapter(policy: Any) -> None:
    """The base model again: LoRA's B matrices to zero (A keeps its random init, as at the start)."""
    with torch.no_grad():
        for name, param in policy.named_trainable().items():
            if "lora_B" in name:
                param.zero_()


def protected(root: Path, name: str, promoted: int) -> set[int]:
    """Versions pruning must spare: the incumbent, a pinned one, a rollback target, and what
    serves (the guard's newest promoted: one promoted after the trainer stopped waiting for its
    verdict serves, though the trainer counts an older incumbent)."""
    control = adapters.control(root, name)
    keep = {promoted, adapters.to_serve(root, name)}
    if control.get("pinned") is not None:
        keep.add(int(control["pinned"]))
    if control.get("rollback"):
        keep.add(int(control["rollback"]["to"]))
    return keep
