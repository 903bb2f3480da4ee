"""The trainer loop, top to bottom: lease -> prepare -> forward/backward -> step -> publish v+1 ->
checkpoint -> ack.

Exactly-once training across crashes: the checkpoint records the lease it trained on, and is
written before the ack. A crash before the checkpoint loses that step's update, and the lease
expires and returns its samples, so they are trained (once) again. A crash after it: resuming
acks that lease first, so its samples are never trained twice.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from clawr1.core.config import Config, public_dump
from clawr1.core.records import adapter_name
from clawr1.datapool.base import DataPool
from clawr1.engine import adapters
from clawr1.engine.models import resolve_model
from clawr1.trainer import checkpoint, history
from clawr1.trainer.batch import Prepared, TrainSample, prepare
from clawr1.trainer.losses import kl_to_reference, ppo_loss
from clawr1.trainer.policy import Policy, pack

log = logging.getLogger(__name__)


class Trainer:
    """Trains one adapter: the shared `policy` on every tenant's samples (`tenant=None`), or one
    tenant's own adapter on that tenant's samples only. Per-tenant trainers share one `Policy`
    (one base model, an adapter each) and keep their own optimizer, checkpoint, versions and log."""

    def __init__(self, config: Config, pool: DataPool, *, resume: bool = True, tenant: str | None = None,
                 policy: Policy | None = None):
        self.config, self.tc, self.pool, self.tenant = config, config.trainer, pool, tenant
        if self.tc.threads:
            torch.set_num_threads(self.tc.threads)
        self.root = Path(config.data_dir)
        # LoRA versions are adapters; full fine-tuning publishes whole models (`trainer.finetune`).
        self.publish = adapters.publish_weights if self.tc.finetune == "full" else adapters.publish
        self.adapter_root = self.root / ("weights" if self.tc.finetune == "full" else "adapters")
        self.adapter = adapter_name(tenant)
        self.policy = policy or Policy(resolve_model(config.engine.model, config.data_dir), self.tc, self.adapter)
        self.policy.add(self.adapter)
        self.policy.activate(self.adapter)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=self.tc.lr, weight_decay=self.tc.weight_decay)
        self.step_count = 0
        self.version = 0  # the newest version of this adapter published (0 = base model)
        self.history = history.MetricsLog(self.root, self.tc.wandb_project, public_dump(config), tenant)
        if resume:
            self.resume()

    # ---- persistence ---------------------------------------------------------------------------
    def resume(self) -> None:
        state = checkpoint.load(checkpoint.path_of(self.root, self.tenant), self.policy, self.optimizer)
        published = adapters.latest(self.adapter_root, self.adapter)
        if state is not None:
            self.step_count, self.version = state["step"], state["version"]
            if state.get("lease_id"):
                self.pool.ack(state["lease_id"])  # trained and checkpointed: never train it again
        # A version published after the last checkpoint (crash in between) keeps its number.
        self.version = max(self.version, published[0] if published else 0)

    # ---- one step ------------------------------------------------------------------------------
    def ready(self) -> bool:
        self.pool.expire_leases()  # a crashed trainer's lease returns its samples here
        count, oldest = self.pool.ready_state(self.tenant)
        return count >= self.tc.batch_size or (count > 0 and time.time() - oldest >= self.tc.max_wait_s)

    def run_once(self) -> dict[str, Any] | None:
        """Train on one leased batch if one is due; returns the step's metrics."""
        if not self.ready():
            return None
        self.policy.activate(self.adapter)  # another tenant's trainer may have used the shared base
        lease = self.pool.lease(self.tc.batch_size, current_version=self.version, tenant=self.tenant)
        if not lease.step_ids:
            return None
        started = time.perf_counter()
        samples = self.load(lease)
        metrics = self.train_step(samples)
        self.version += 1
        t = time.perf_counter()
        self.publish(self.policy.model, self.adapter_root, self.adapter, self.version)
        metrics["publish_s"] = time.perf_counter() - t
        checkpoint.save(checkpoint.path_of(self.root, self.tenant), self.policy, self.optimizer,
                        {"step": self.step_count, "version": self.version, "lease_id": lease.lease_id})
        self.pool.ack(lease)
        metrics.update(version=self.version, lease=len(lease), lease_id=lease.lease_id,
                       total_s=time.perf_counter() - started,
                       staleness=sum(self.version - 1 - s.policy_version for s in lease.samples) / len(lease))
        self.log(metrics)
        return metrics

    def load(self, lease: Any) -> list[TrainSample]:
        steps = self.pool.get_steps(lease.step_ids)
        hints = self.pool.hints(lease.step_ids)
        return [TrainSample(step, sample.reward, sample.weight, hints.get(step.step_id))
                for step, sample in zip(steps, lease.samples, strict=True)]

    def train_step(self, samples: list[TrainSample]) -> dict[str, Any]:
        """One optimizer step on a batch, in micro-batches whose losses sum to the batch's
        token-mean objective."""
        t0 = time.perf_counter()
        micro = [prepare(self.policy, samples[i:i + self.tc.micro_batch], self.tc)
                 for i in range(0, len(samples), self.tc.micro_batch)]
        t1 = time.perf_counter()
        total = sum(float(m.mask.sum()) for m in micro)
        sums: dict[str, float] = {"loss": 0.0, "ratio": 0.0, "clip_frac": 0.0, "kl": 0.0, "adv_mean": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        for m in micro:
            if m.mask.sum() == 0:
                continue
            share = float(m.mask.sum()) / total
            loss, stats = self.loss(m)
            (loss * share).backward()
            sums["loss"] += loss.item() * share
            for key in ("ratio", "clip_frac", "kl", "adv_mean"):
                sums[key] += float(stats[key]) * share
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.tc.grad_clip)) if total else 0.0
        if total:
            self.optimizer.step()
        self.step_count += 1
        t2 = time.perf_counter()
        stats = {key: sum(m.stats[key] for m in micro) for key in ("samples", "usable", "tokens")}
        rewarded = [s.reward for s in samples if s.reward]
        return {"step": self.step_count, **sums, "grad_norm": grad_norm, **stats,
                "reward_mean": sum(rewarded) / len(rewarded) if rewarded else 0.0,
                "hint_rate": sum(1 for s in samples if s.hint) / len(samples),
                "prepare_s": t1 - t0, "train_s": t2 - t1, "tokens_per_s": stats["tokens"] / max(t2 - t0, 1e-9)}

    def loss(self, m: Prepared) -> tuple[torch.Tensor, dict[str, float]]:
        logp = self.policy.logprobs(m.rows)
        loss, stats = ppo_loss(logp, m.behaviour, m.advantage, m.mask, self.tc.eps_low, self.tc.eps_high)
        kl = torch.zeros(())
        if self.tc.kl_coef > 0:
            with torch.no_grad(), self.policy.adapter_off():
                reference = self.policy.logprobs(m.rows)
            kl = kl_to_reference(logp, reference, m.mask)
            loss = loss + self.tc.kl_coef * kl
        adv = float((m.advantage * m.mask).sum() / m.mask.sum().clamp(min=1))
        return loss, {"ratio": float(stats["ratio"]), "clip_frac": float(stats["clip_frac"]), "kl": float(kl),
                      "adv_mean": adv}

    @torch.no_grad()
    def sequence_logprob(self, prompt_ids: list[int], reply_ids: list[int], temperature: float = 1.0) -> float:
        """Sum of the policy's logprobs of a reply (for tests and the demo's probes)."""
        return float(self.policy.logprobs(pack([prompt_ids], [reply_ids], [temperature], self.policy.pad_id)).sum())

    # ---- metrics -------------------------------------------------------------------------------
    def log(self, metrics: dict[str, Any]) -> None:
        self.history.write(metrics, self.step_count)

    def close(self) -> None:
        self.history.close()

    def run(self, stop: Any) -> None:
        """Train until `stop.is_set()`; idle polls are cheap reads."""
        while not stop.is_set():
            if self.run_once() is None:
                stop.wait(self.tc.poll_s)
