"""The trainer's side of the guard: wait for the verdict on each published version, roll back to the
incumbent when it is rejected, apply an admin's rollback, and prune old versions.

The incumbent's state (LoRA weights, AdamW moments, RNG, counters) is kept as a second checkpoint,
`trainer/promoted`, written whenever a version is promoted; at the very start it is the initial
LoRA (the base model, v0). A rejected version is then undone exactly: the policy and optimizer go
back to that checkpoint and the main checkpoint is rewritten, so a restart resumes from the
incumbent too. Version numbers keep increasing (the rejected one stays on disk with its verdict).

Undone exactly, a rejection alone would not let training progress: the next candidate is again
one step from the same state, and from the base (a fresh AdamW, its warm-up restarted) every
first step moves every weight by the same lr whatever the batch. So each rejection in a row
multiplies the learning rate by `trainer.reject_backoff` until a version is promoted; the next
candidate also trains on other samples (the rejected version's were acknowledged).
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


def load_published(policy: Any, path: Path, adapter: str, ranks: Any = None) -> None:
    """Copy a published LoRA version's weights into the trainer's adapter (an admin rollback to a
    version whose optimizer state is gone: the moments start afresh). With `ranks`, rank 0 reads
    them and sends them to the others (which need not share its disk)."""
    from peft import set_peft_model_state_dict

    lead = ranks is None or ranks.lead
    state = load_file(Path(path) / "adapter_model.safetensors") if lead else None
    state = ranks.broadcast(state) if ranks is not None else state
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


class GuardSide:
    """The `Trainer`'s methods for the guard's verdicts and an admin's rollback, kept here beside
    the files they read and write. They act on the trainer's state (`policy`, `optimizer`,
    `version`, `promoted`, `weights_of`, `rejections`, `rollbacks`, `ranks`) and its `save`."""

    def keep_promoted(self, candidate: bool = False) -> None:
        """The current state is the incumbent's: what a rejected version rolls back to. `candidate`:
        the state of the newest version, undecided, kept in case the guard promotes it later."""
        if not self.ranks.lead:
            return
        path = (candidate_path(self.root, self.tenant, self.version) if candidate
                else promoted_path(self.root, self.tenant))
        checkpoint.save(path, self.policy, self.optimizer,
                        {"step": self.step_count, "version": self.version if candidate else self.promoted})

    def adopt_late_verdicts(self) -> None:
        """A version the guard promoted after the trainer stopped waiting is the incumbent now."""
        late = self.ranks.broadcast(adopt_late(self.root, self.tenant, self.adapter_root, self.adapter,
                                               self.promoted, self.tc.keep_versions) if self.ranks.lead else None)
        if late is not None:
            self.promoted = late
            self.save()

    def restore_promoted(self) -> None:
        state = checkpoint.load(promoted_path(self.root, self.tenant), self.policy, self.optimizer)
        if state is None:
            raise RuntimeError("no promoted checkpoint to roll back to")

    def await_verdict(self, stop: Any = None) -> dict[str, Any]:
        """Wait for the guard's verdict on the version just published: promoted, it becomes the
        incumbent; rejected, the policy and optimizer go back to the incumbent's state."""
        verdict = self.ranks.broadcast(
            wait_for_verdict(self.adapter_root, self.adapter, self.version, self.config.guard.decision_timeout_s,
                             self.tc.poll_s, stop) if self.ranks.lead else None)
        return self.apply_verdict(verdict)

    def apply_verdict(self, verdict: dict[str, Any] | None) -> dict[str, Any]:
        """Act on the guard's verdict on the newest version (None: undecided, training goes on)."""
        status = verdict["status"] if verdict else "undecided"
        if status == "promoted":
            self.promoted, self.rejections = self.version, 0
            self.keep_promoted()
            self.save()
        elif status == "rejected":
            self.adopt_late_verdicts()  # an earlier version promoted meanwhile is what to go back to
            self.restore_promoted()
            # Back at the incumbent's state, the next candidate would be the same kind of step:
            # from the base, a fresh optimizer's first (warm-up) step moves every weight by the
            # same lr whatever the batch, and it was rejected. A smaller one can pass.
            self.weights_of, self.rejections = self.promoted, self.rejections + 1
            self.save()
            log.warning("v%d rejected by the guard (%s); training on from v%d, the next step's learning rate x%g "
                        "(%d rejected in a row)", self.version, verdict["reason"], self.promoted,
                        self.tc.reject_backoff ** self.rejections, self.rejections)
        else:
            self.keep_promoted(candidate=True)
        return {"verdict": status, "promoted": self.promoted}

    def apply_rollback(self) -> None:
        """An admin's `clawr1 rollback N` (the adapter's `CONTROL`): train on from version N."""
        request = self.ranks.broadcast(adapters.control(self.adapter_root, self.adapter).get("rollback")
                                       if self.ranks.lead else None)
        if not request or request.get("id") in self.rollbacks:
            return
        to = int(request["to"])
        self.accumulated = None  # a version in the making is dropped: its leases expire and come back
        self.optimizer.zero_grad(set_to_none=True)
        if self.guarded and to == self.promoted:
            self.restore_promoted()
        elif to == self.weights_of and not self.guarded:
            pass  # the version it holds (the guard off: the newest): only the version in the making goes
        elif to == 0:
            zero_adapter(self.policy)
            self.optimizer = self.new_optimizer()
        else:  # an older version: its weights are on disk, its optimizer moments are not
            load_published(self.policy, adapters.version_dir(self.adapter_root, self.adapter, to), self.adapter,
                           self.ranks)
            self.optimizer = self.new_optimizer()
        self.promoted = self.weights_of = to
        self.rollbacks.append(request["id"])
        if self.guarded:
            self.keep_promoted()
            if self.ranks.lead:
                drop_candidates(self.root, self.tenant)
        self.save()
        log.warning("rolled back to v%d by an admin; the next version is v%d", to, self.version + 1)
