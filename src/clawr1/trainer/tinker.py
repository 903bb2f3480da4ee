"""Training through a Tinker-compatible service (`trainer.backend = "tinker"`): no GPU here.

The service holds the base model and a LoRA adapter; this process leases samples from the pool,
computes every sample's per-token advantages exactly as the local trainer does (`rl_advantages`,
the OPD teacher's logprobs, `token_advantages`), and sends them as datums for the service's `ppo`
loss. The local loss is a token mean; the service sums the token losses, so each advantage is
divided by the version's training-token count here, and the gradient is the local one. Then
`optim_step` (AdamW with the local hyperparameters and gradient clip), `save_state` (weights and
optimizer, for resume and rollback) and `save_weights_for_sampler` (what serves the version).

What differs from the local trainer, because the service's loss takes per-token advantages only:
the KL to the base model enters as a per-token reward penalty, `-kl_coef * (behaviour - base)` on
each sampled token (the k1 estimate, the classic RLHF shaping), instead of the exact vocabulary KL;
the OPD teacher is the base model with the hint (`teacher = "base"`), scored by the service's base
sampler; `opd_estimator = "full"` and the entropy band are refused (config). The service scores at
temperature 1, so its importance ratio is exact for replies sampled at temperature 1.

Exactly once, as locally: the lease is acknowledged only after the service confirmed the step,
saved the state, and this process checkpointed that state's path (`trainer/checkpoint/state.json`);
a crash before that returns the samples, and a restart resumes from the last saved state.

`service`: the SDK's `ServiceClient` (URL and key from `TINKER_BASE_URL` / `TINKER_API_KEY`), or
any object with its methods (the tests' in-process fake backed by a torch model).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from clawr1.core.config import Config, public_dump
from clawr1.core.records import POLICY
from clawr1.core.tinker import service_client
from clawr1.datapool.base import PoolQueue
from clawr1.engine import adapters
from clawr1.engine.chat import ChatFormat
from clawr1.engine.models import resolve_model
from clawr1.engine.tokenizer import load_tokenizer
from clawr1.trainer import checkpoint, guarded, history
from clawr1.trainer.accumulate import scheduled_lr
from clawr1.trainer.batch import (
    TrainSample,
    hinted_prompt,
    load_samples,
    per_sample,
    resolved,
    rl_advantages,
    token_advantages,
)
from clawr1.trainer.losses import opd_advantage
from clawr1.trainer.ranks import Ranks

log = logging.getLogger(__name__)


def _types() -> Any:
    from tinker import types

    return types


class TinkerTrainer:
    """The trainer loop of `loop.Trainer` (lease, step, publish, checkpoint, ack, guard) with the
    step on the service."""

    def __init__(self, config: Config, pool: PoolQueue, *, service: Any = None, resume: bool = True):
        self.config, self.tc, self.pool, self.tenant = config, resolved(config), pool, None
        self.ranks = Ranks()  # one process: the service is the data-parallel part
        self.timeout = config.tinker.timeout_s
        self.base_model = config.tinker.base_model
        self.root = Path(config.data_dir)
        self.adapter_root, self.adapter = self.root / "adapters", POLICY
        self.chat = ChatFormat(load_tokenizer(resolve_model(config.engine.model, config.data_dir)))
        self.service = service if service is not None else service_client()
        self.guarded = config.guard.enabled
        self.step_count = self.version = self.promoted = self.weights_of = self.skipped = 0
        self.reward_baseline = 0.0
        self.rollbacks: list[str] = []  # the admin rollbacks already applied (ids)
        self.state_path: str | None = None  # the service's saved state of the newest version
        self.promoted_state: str | None = None  # ... and of the incumbent (a rejected version goes back to it)
        saved = self._read_state() if resume else None
        if saved:
            self.step_count, self.version = saved["step"], saved["version"]
            self.promoted, self.weights_of = saved.get("promoted", self.version), saved.get("weights_of", self.version)
            self.reward_baseline = saved.get("reward_baseline", 0.0)
            self.state_path, self.promoted_state = saved.get("tinker_state"), saved.get("tinker_promoted")
            self.rollbacks = saved.get("rollbacks", [])
            for lease_id in saved.get("lease_ids", []):
                self.pool.ack(lease_id)  # trained and checkpointed: never train it again
        # A version published after the last checkpoint (a crash in between) keeps its number; its
        # samples were not acknowledged, so they come back and train the next one.
        published = adapters.latest(self.adapter_root, self.adapter)
        self.version = max(self.version, published[0] if published else 0)
        self.training = self._training_client(self.state_path)
        self.base = self._result(self.service.create_sampling_client(base_model=self.base_model))
        self.history = history.MetricsLog(self.root, self.tc.wandb_project, public_dump(config))

    # ---- the service -----------------------------------------------------------------------
    def _result(self, future: Any) -> Any:
        """An SDK future's value within `tinker.timeout_s` (a client the SDK hands back directly
        passes through)."""
        return future.result(timeout=self.timeout) if hasattr(future, "result") else future

    def _training_client(self, state: str | None) -> Any:
        """From a saved state (weights and AdamW moments), or a fresh LoRA on the base model."""
        if state:
            return self._result(self.service.create_training_client_from_state_with_optimizer(state))
        # No LoRA on the unembedding, as locally (the local head is fused with the log-softmax).
        return self._result(self.service.create_lora_training_client(self.base_model, rank=self.tc.lora_rank,
                                                                     seed=self.tc.seed, train_unembed=False))

    def _logprobs(self, client: Any, pairs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
        """The client's logprobs of each `reply` after its `prompt` (teacher-forced, temperature 1):
        every request is sent first, then the answers are collected (one round trip, not one each)."""
        types = _types()
        futures = [client.compute_logprobs(types.ModelInput.from_ints(prompt + reply), prompt_logprobs_last_n=len(reply))
                   for prompt, reply in pairs]
        return [torch.tensor([float(x) for x in self._result(f)[-len(reply):]])
                for f, (_, reply) in zip(futures, pairs, strict=True)]

    # ---- one version -------------------------------------------------------------------------
    def ready(self) -> int:
        """One lease per version (the service accumulates nothing between calls): a batch once
        `min_samples` (else `batch_size`) are READY, or the oldest waited `max_wait_s`."""
        self.pool.expire_leases()
        count, oldest = self.pool.ready_state(None)
        enough = min(self.tc.min_samples or self.tc.batch_size, self.tc.batch_size)
        due = count >= enough or (count > 0 and time.time() - oldest >= self.tc.max_wait_s)
        return self.tc.batch_size if due else 0

    def run_once(self, stop: Any = None) -> dict[str, Any] | None:
        self.apply_rollback()
        wanted = self.ready()
        if not wanted:
            return None
        started = time.perf_counter()
        lease = self.pool.lease(wanted, current_version=self.weights_of)
        samples = per_sample(load_samples(self.pool, lease), self.tc)
        datums, metrics = self.datums(samples)
        if not datums:  # no sample had a signal: nothing to train, nothing to lose
            self.pool.ack(lease.lease_id)
            self.skipped += 1
            return None
        types = _types()
        for _ in range(self.tc.epochs):  # each pass recomputes the PPO ratios under the moved weights
            step = self._result(self.training.forward_backward(
                datums, "ppo", {"clip_low_threshold": 1 - self.tc.eps_low, "clip_high_threshold": 1 + self.tc.eps_high}))
            lr = scheduled_lr(self.tc, self.step_count + 1)
            self._result(self.training.optim_step(types.AdamParams(
                learning_rate=lr, beta1=0.9, beta2=0.999, eps=1e-8,  # torch.optim.AdamW's, as the local trainer
                weight_decay=self.tc.weight_decay, grad_clip_norm=self.tc.grad_clip)))
            self.step_count += 1
        self.version += 1
        self.weights_of = self.version
        name = f"clawr1-v{self.version}"
        self.state_path = self._result(self.training.save_state(name)).path
        sampler = self._result(self.training.save_weights_for_sampler(name)).path
        adapters.publish_remote(self.adapter_root, self.adapter, self.version,
                                {"sampler_path": sampler, "state_path": self.state_path, "base_model": self.base_model},
                                rollback=self.rollbacks[-1] if self.rollbacks else None)
        self._write_state([lease.lease_id])  # checkpoint first, then the ack: exactly once across crashes
        self.pool.ack(lease.lease_id)
        service = {k: float(v) for k, v in (getattr(step, "metrics", None) or {}).items()}
        metrics.update(version=self.version, step=self.step_count, lr=lr, lease=len(samples), lease_id=lease.lease_id,
                       backend="tinker", service_metrics=service, loss=service.get("loss:sum", 0.0))
        if self.guarded:
            metrics.update(self.await_verdict(stop))
        metrics["total_s"] = time.perf_counter() - started
        self.history.write(metrics, self.step_count)
        history.record_in_pool(self.pool, self.adapter, metrics)
        return metrics

    def datums(self, samples: list[TrainSample]) -> tuple[list[Any], dict[str, Any]]:
        """The service's datums for `samples` and the version's metrics: per sample, the tokens
        (prompt + reply, shifted by one for the targets), the sampler's logprobs and the advantages
        on the reply positions (zeros on the prompt), each advantage divided by the training tokens."""
        types = _types()
        steps = [s.step for s in samples]
        k = max([len(s.token_ids) for s in steps] + [1])
        reply_mask, behaviour = torch.zeros(len(steps), k), torch.zeros(len(steps), k)
        for i, step in enumerate(steps):
            n = len(step.token_ids)
            if n:
                reply_mask[i, k - n:] = 1
                behaviour[i, k - n:] = torch.tensor(step.logprobs or [0.0] * n)
        rl, self.reward_baseline = rl_advantages(samples, self.tc, self.reward_baseline)
        opd = torch.zeros(len(steps), k)
        if self.tc.method != "rl":
            hinted = [i for i, s in enumerate(samples) if s.hint and s.step.token_ids]
            teachers = self._logprobs(self.base, [(hinted_prompt(self.chat, samples[i].step, samples[i].hint or "",
                                                                 self.tc.hint_at), samples[i].step.token_ids)
                                                  for i in hinted])
            for i, teacher in zip(hinted, teachers, strict=True):
                n = len(steps[i].token_ids)
                opd[i, k - n:] = opd_advantage(teacher, behaviour[i, k - n:], self.tc.opd_clip)
        advantage, mask, usable = token_advantages(samples, self.tc, rl, opd, reply_mask)
        kl = 0.0
        if self.tc.kl_coef > 0:
            scored = [i for i, step in enumerate(steps) if usable[i] and step.token_ids]
            bases = self._logprobs(self.base, [(steps[i].prompt_ids, steps[i].token_ids) for i in scored])
            for i, base in zip(scored, bases, strict=True):
                n = len(steps[i].token_ids)
                penalty = behaviour[i, k - n:] - base
                advantage[i, k - n:] -= self.tc.kl_coef * penalty
                kl += float(penalty.sum())
        tokens = float(mask.sum())
        out = []
        for i, step in enumerate(steps):
            n = len(step.token_ids)
            if not n or not mask[i].any():
                continue
            ids, pad = step.prompt_ids + step.token_ids, len(step.prompt_ids) - 1
            out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
                "target_tokens": ids[1:],
                "logprobs": [0.0] * pad + behaviour[i, k - n:].tolist(),
                "advantages": [0.0] * pad + (advantage[i, k - n:] * mask[i, k - n:] / tokens).tolist()}))
        rewarded = [s.reward for s in samples if s.reward]
        return out, {"samples": float(len(samples)), "usable": float(usable.sum()), "tokens": tokens,
                     "kl_base_k1": kl / tokens if tokens else 0.0, "adv_mean": float((advantage * mask).sum()) / max(tokens, 1),
                     "reward_mean": sum(rewarded) / len(rewarded) if rewarded else 0.0,
                     "hint_rate": sum(1 for s in samples if s.hint) / max(len(samples), 1),
                     "reward_baseline": self.reward_baseline, "loss": 0.0, "clip_frac": 0.0}

    def await_verdict(self, stop: Any = None) -> dict[str, Any]:
        """The guard's verdict on the version just published: promoted, it is the incumbent;
        rejected, the service's training client goes back to the incumbent's saved state."""
        verdict = guarded.wait_for_verdict(self.adapter_root, self.adapter, self.version,
                                           self.config.guard.decision_timeout_s, self.tc.poll_s, stop)
        status = verdict["status"] if verdict else "undecided"
        if status == "promoted":
            self.promoted, self.promoted_state = self.version, self.state_path
        elif status == "rejected":
            self.training = self._training_client(self.promoted_state)
            self.weights_of, self.state_path = self.promoted, self.promoted_state
            log.warning("v%d rejected by the guard (%s); training on from v%d", self.version, verdict["reason"],
                        self.promoted)
        self._write_state([])
        return {"verdict": status, "promoted": self.promoted}

    def apply_rollback(self) -> None:
        """An admin's `clawr1 rollback N`: the training client goes back to version N's saved state
        (its `remote.json`), or to a fresh LoRA for N = 0, and training goes on from there."""
        request = adapters.control(self.adapter_root, self.adapter).get("rollback")
        if not request or request.get("id") in self.rollbacks:
            return
        to = int(request["to"])
        state = None
        if to:
            remote = adapters.version_dir(self.adapter_root, self.adapter, to) / adapters.REMOTE
            state = json.loads(remote.read_text())["state_path"]
        self.training = self._training_client(state)
        self.promoted = self.weights_of = to
        self.state_path = self.promoted_state = state
        self.rollbacks.append(request["id"])
        self._write_state([])
        log.warning("rolled back to v%d by an admin; the next version is v%d", to, self.version + 1)

    # ---- the local checkpoint: where the service's state is ------------------------------------
    def _write_state(self, lease_ids: list[str]) -> None:
        path = checkpoint.path_of(self.root)
        path.mkdir(parents=True, exist_ok=True)
        adapters.write_json(path / "state.json", {
            "step": self.step_count, "version": self.version, "lease_ids": lease_ids, "promoted": self.promoted,
            "weights_of": self.weights_of, "reward_baseline": self.reward_baseline, "backend": "tinker",
            "tinker_state": self.state_path, "tinker_promoted": self.promoted_state, "rollbacks": self.rollbacks})

    def _read_state(self) -> dict[str, Any] | None:
        path = checkpoint.path_of(self.root) / "state.json"
        if not path.is_file():
            return None
        state = json.loads(path.read_text())
        if state.get("backend") != "tinker":
            raise RuntimeError(f"{path} is a local trainer's checkpoint; trainer.backend = \"tinker\" cannot "
                               "resume it (use a new data_dir or trainer.backend = \"local\")")
        return state

    def close(self) -> None:
        self.history.close()

    def run(self, stop: Any) -> None:
        from clawr1.trainer.loop import train_until

        train_until(self, stop, poll_s=self.tc.poll_s)


__all__ = ["TinkerTrainer"]
