"""The trainer loop, top to bottom: lease -> prepare -> forward/backward (accumulated over leases
until the version is due) -> step -> publish v+1 -> checkpoint -> ack -> the guard's verdict.

Exactly-once training across crashes: the checkpoint records the leases a version trained on, and
is written before their acks. A crash before the checkpoint loses that step's update, and the
leases expire and return their samples, so they are trained (once) again. A crash after it:
resuming acks those leases first, so their samples are never trained twice.

The guard (`guarded.py`): each published LoRA version is a candidate; the trainer waits for the
verdict, and a rejected version is undone (weights and optimizer back to the incumbent's).

A version that cannot train (a pass out of memory, a NaN or inf gradient norm) is given back, not
published: its leases return at once with the suspect samples charged an attempt, and the pool
drops a sample that keeps failing as poison (`give_back`), so no sample kills the trainer forever.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from clawr1.core.config import Config, public_dump
from clawr1.core.records import adapter_name
from clawr1.datapool.base import PoolQueue
from clawr1.engine import adapters
from clawr1.engine.models import resolve_model
from clawr1.trainer import accumulate, checkpoint, consolidate, guarded, history, sharded
from clawr1.trainer.accumulate import HINTED_SUMS, Accumulated, optimizer_steps, scheduled_lr, version_due
from clawr1.trainer.batch import (
    MEMORY_SUFFIX,
    Prepared,
    TrainSample,
    add_gaps,
    load_samples,
    micro_batches,
    per_sample,
    prepare,
    relabelled,
    resolved,
    rl_advantages,
)
from clawr1.trainer.losses import entropy_band, kl_to_reference, masked_mean, ppo_loss, stop_kl
from clawr1.trainer.policy import Policy, pack
from clawr1.trainer.ranks import Ranks

log = logging.getLogger(__name__)
# Why a turn left training unused, as the pool records it (`probe`, a turn the guard holds out, is by
# design): its session closed before any feedback (`masked`), it grew older than
# `pool.max_staleness` versions while it waited (`stale`), its training failed too often (`poison`).
# The judge giving up on a turn (`reward.max_judge_attempts`) is counted beside them as `judge`.
LOST = ("masked", "stale", "poison")


class Trainer(guarded.GuardSide):
    """Trains one adapter: the shared `policy` on every tenant's samples (`tenant=None`), or one
    tenant's own adapter on that tenant's samples only. Per-tenant trainers share one `Policy`
    (one base model, an adapter each) and keep their own optimizer, checkpoint, versions and log."""

    def __init__(self, config: Config, pool: PoolQueue, *, resume: bool = True, tenant: str | None = None,
                 policy: Policy | None = None, ranks: Ranks | None = None):
        """`ranks`: this process's place in a data-parallel trainer group (`ranks.py`); only its
        rank 0 touches the pool's leases and the disk, the others train their share."""
        self.config, self.tc, self.pool, self.tenant = config, resolved(config), pool, tenant
        self.ranks = ranks or Ranks()
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
        if self.tc.finetune == "full":  # written in the dtype it computes in, not its float32 master copy
            self.publish = functools.partial(adapters.publish_weights, dtype=self.policy.dtype)
        # Full fine-tuning over several ranks shards the decoder layers (FSDP2); LoRA replicates.
        self.sharded = self.ranks.world > 1 and self.tc.finetune == "full"
        if self.sharded:
            if self.tc.teacher != "base":  # the EMA's shadow weights are not gathered into checkpoints either
                raise ValueError(f"trainer.teacher = {self.tc.teacher!r} with sharded full fine-tuning: a teacher "
                                 "forward through the sharded policy would run on some ranks only; use "
                                 "trainer.teacher = \"base\" (the default) or one rank")
            if self.tc.relabel > 0:  # its behaviour pass runs on the ranks holding relabelled rows only
                raise ValueError("trainer.relabel with sharded full fine-tuning: use LoRA or one rank")
            sharded.shard(self.policy.model)
        self.optimizer = self.new_optimizer()
        self.step_count = 0
        self.version = 0  # the newest version of this adapter published (0 = base model)
        # The guard decides each LoRA version; the trainer waits for it and undoes a rejected one.
        self.guarded = config.guard.enabled and self.tc.finetune == "lora"
        if config.guard.enabled and not self.guarded and self.ranks.lead:
            # Said once at start: otherwise a user who left the guard on believes it protects them.
            log.warning("full fine-tuning is not guarded: every version is served as published, with no probe "
                        "and no rollback (the guard needs a candidate beside the served version: LoRA only)")
        # An admin's rollback applies to LoRA versions with the guard on or off (off, the gateway
        # serves every version as published, so each one is the incumbent).
        self.rolls_back = self.tc.finetune == "lora"
        self.promoted = 0  # the incumbent: the newest promoted version (0 = the base model)
        # The version whose weights the trainer holds: the newest published, or after a rejection
        # or a rollback the one it went back to. Staleness counts from here: after a run of rejected
        # candidates the served incumbent's samples are on-policy, not `version - promoted` behind.
        self.weights_of = 0
        self.rollbacks: list[str] = []  # the admin rollbacks already applied (ids)
        # What the pool had lost when the last version was published (`lost_so_far`; rank 0).
        self.lost_seen = self.lost_so_far() if self.ranks.lead else {}
        self.history = (history.MetricsLog(self.root, self.tc.wandb_project, public_dump(config), tenant)
                        if self.ranks.lead else None)
        if resume:
            self.resume()
        if self.guarded and not (guarded.promoted_path(self.root, tenant) / "state.json").is_file():
            self.keep_promoted()  # the state to fall back to: the initial LoRA, or what a resume restored

    def new_optimizer(self, foreach: bool | None = None) -> torch.optim.AdamW:
        """A fresh AdamW over the trainable parameters (`foreach`: None, torch's choice)."""
        return sharded.adamw(self.policy.parameters(), self.tc.lr, self.tc.weight_decay, foreach)

    # ---- persistence ---------------------------------------------------------------------------
    def resume(self) -> None:
        # (rank 0 reads the disk, and the others receive what it read: they may not share it)
        state = checkpoint.load(checkpoint.path_of(self.root, self.tenant), self.policy, self.optimizer)
        published = self.ranks.broadcast(adapters.latest(self.adapter_root, self.adapter) if self.ranks.lead else None)
        if state is not None:
            self.step_count, self.version = state["step"], state["version"]
            self.promoted, self.rollbacks = state.get("promoted", self.version), state.get("rollbacks", [])
            self.reward_baseline, self.rejections = state.get("reward_baseline", 0.0), state.get("rejections", 0)
            # (A checkpoint from before `weights_of` holds the incumbent's weights after a rejection.)
            self.weights_of = state.get("weights_of", self.promoted if self.guarded else self.version)
            for lease_id in state.get("lease_ids", [state["lease_id"]] if state.get("lease_id") else []):
                if self.ranks.lead:
                    self.pool.ack(lease_id)  # trained and checkpointed: never train it again
        # A version published after the last checkpoint (crash in between) keeps its number.
        self.version = max(self.version, published[0] if published else 0)
        if state is not None and self.guarded and self.weights_of > self.promoted:
            # The last life stopped before the guard decided what the trainer holds: decided since,
            # it is applied now (rejected: back to the incumbent), so no rejected weights train on.
            verdict = self.ranks.broadcast(adapters.verdict(self.adapter_root, self.adapter, self.weights_of)
                                           if self.ranks.lead else None)
            if verdict is not None and self.weights_of == self.version:
                self.apply_verdict(verdict)

    # ---- one step ------------------------------------------------------------------------------
    accumulated: Accumulated | None = None  # the version being accumulated (`train_step`); None: no gradients kept
    reward_baseline: float = 0.0  # the online rewards' moving average (`trainer.baseline`), to checkpoint
    skipped: int = 0  # batches acknowledged without a version: no sample had a trainable token
    nonfinite_steps: int = 0  # optimizer steps skipped: the gradient norm was NaN or inf
    failed_versions: int = 0  # versions given back untrained (`give_back`)
    rejections: int = 0  # candidates the guard rejected since the last promotion (`reject_backoff`)

    def ready(self) -> int:
        """How many samples to lease now; 0: nothing to do yet.

        Without `trainer.min_samples`: a whole batch, once `batch_size` samples are READY or the
        oldest waited `max_wait_s`. With it: whatever is READY, up to the room left in the version
        being accumulated; and that room also when nothing is READY but the version is due
        (`version_due`), so that `train_step` steps it."""
        self.pool.expire_leases()  # a crashed trainer's lease returns its samples here
        count, oldest = self.pool.ready_state(self.tenant)
        if self.tc.min_samples is None:
            due = count >= self.tc.batch_size or (count > 0 and accumulate.clock() - oldest >= self.tc.max_wait_s)
            return self.tc.batch_size if due else 0
        acc = self.accumulated
        if count == 0 and (acc is None or not version_due(acc, self.tc, self.config.pool.lease_seconds)):
            return 0
        return self.tc.batch_size - (acc.leased if acc else 0)

    def run_once(self, stop: Any = None) -> dict[str, Any] | None:
        """Lease what is due, accumulate its gradients, and once the version is due (`min_samples`
        or `max_wait_s`): step, publish v+1, checkpoint, ack every lease it trained on, and wait for
        the guard's verdict (cut short when `stop`, an Event, is set: the version is left
        undecided, and the next start reads its verdict). Returns that version's metrics (None
        while nothing was published)."""
        if self.guarded:  # first, so that a rollback to a version promoted late restores it exactly
            self.adopt_late_verdicts()
        if self.rolls_back:
            self.apply_rollback()
        started = time.perf_counter()
        samples = self.ranks.broadcast(self.take() if self.ranks.lead else None)  # rank 0's lease, to all
        if samples is None:
            return None
        self.policy.activate(self.adapter)  # another tenant's trainer may have used the shared base
        metrics = self.train_step(samples)
        if metrics is None:  # still accumulating (or nothing came): gradients kept, nothing acked
            return None
        lead = self.ranks.lead
        if not metrics["tokens"]:  # no sample had a signal (routine under `opd` without hints)
            for lease_id in metrics["lease_ids"] if lead else ():
                self.pool.ack(lease_id)  # nothing to train, so nothing to lose: no checkpoint needed
            self.skipped += 1
            log.info("a batch of %d samples had no trainable token: acknowledged, no version published (%d so far)",
                     int(metrics["samples"]), self.skipped)
            return None
        gaps, measured_on = metrics.pop("memory_gaps", {}), self.weights_of
        self.version += 1
        self.weights_of = self.version
        self.say_what_it_learned_from(metrics)
        t = time.perf_counter()
        whole = sharded.gather(self.policy.model, self.optimizer) if self.sharded else None  # every rank's part
        if lead:
            if whole is None:
                self.publish(self.policy.model, self.adapter_root, self.adapter, self.version,
                             rollback=self.rollbacks[-1] if self.rollbacks else None)
            else:
                adapters.publish_weights(self.policy.model, self.adapter_root, self.adapter, self.version,
                                         state_dict=whole[0], dtype=self.policy.dtype)
            metrics["publish_s"] = time.perf_counter() - t
            self.save(metrics["lease_ids"], whole)  # checkpoint first, then the acks: exactly once across crashes
            for lease_id in metrics["lease_ids"]:
                self.pool.ack(lease_id)
        metrics.update(version=self.version, lease=int(metrics["samples"]), skipped=self.skipped,
                       nonfinite_steps=self.nonfinite_steps, failed_versions=self.failed_versions,
                       rejections=self.rejections,
                       ranks=self.ranks.world, param_bytes=sharded.local_bytes(self.policy.model),  # rank 0's
                       lease_id=metrics["lease_ids"][0] if metrics["lease_ids"] else None)
        if self.guarded:  # the candidate waits for the guard; a rejected one is undone
            t = time.perf_counter()
            metrics.update(self.await_verdict(stop))
            metrics["verdict_s"] = time.perf_counter() - t
        else:
            self.promoted = self.version  # served as published
        if lead:
            changed = self.check_memory(gaps, measured_on)
            metrics.update(memory_retired=float(len(changed["retired"])), memory_restored=float(len(changed["restored"])))
            metrics["pruned"] = len(adapters.prune(self.adapter_root, self.adapter, self.tc.keep_versions,
                                                   guarded.protected(self.adapter_root, self.adapter, self.promoted)))
        metrics["total_s"] = time.perf_counter() - started
        self.log(metrics)
        return metrics

    def lost_so_far(self) -> dict[str, int]:
        """Rank 0: the pool's count of turns that left training unused, by why (`LOST`)."""
        stats = self.pool.stats(self.tenant)
        return {**{why: stats["dropped_by_reason"].get(why, 0) for why in LOST}, "judge": stats["judge_gave_up"]}

    def say_what_it_learned_from(self, metrics: dict[str, Any]) -> None:
        """Failures that would otherwise be silent, counted per version (`no_signal`: samples with
        neither a reward nor a hint to train on; `kl_silent`: a KL term configured but exactly 0;
        `lost_<why>`: turns that left training unused since the version before, by why, `LOST`) and
        said in the log when the version trained from little that is useful."""
        metrics["no_signal"] = metrics["samples"] - metrics["usable"]
        # (The first step from the base, or from a rollback to it, starts at the base's weights: its KL
        # is exactly 0 by construction, nothing silent.)
        metrics["kl_silent"] = float(self.tc.kl_coef > 0 and metrics["kl"] == 0.0
                                     and optimizer_steps(self.optimizer) > 1)
        if self.ranks.lead:
            now = self.lost_so_far()
            metrics.update({f"lost_{why}": float(n - self.lost_seen.get(why, 0)) for why, n in now.items()})
            self.lost_seen = now
        lost = sum(v for k, v in metrics.items() if k.startswith("lost_"))
        # (as many turns lost as trained on: half of what users gave never reached the weights)
        if metrics["usable"] < 0.25 * metrics["samples"] or metrics["kl_silent"] or lost >= max(metrics["samples"], 1):
            log.warning("v%d trains on little that is useful: %d of %d samples had a signal (a reward or a hint), "
                        "%.0f%% of reply tokens an advantage of 0; %d turns left training unused since v%d (%s)%s",
                        self.version, metrics["usable"], metrics["samples"], 100 * metrics["adv_zero_frac"], lost,
                        self.version - 1, ", ".join(f"{k[5:]} {v:.0f}" for k, v in metrics.items()
                                                    if k.startswith("lost_") and v) or "none",
                        "; the KL term is configured but 0" if metrics["kl_silent"] else "")

    def take(self) -> list[TrainSample] | None:
        """Rank 0: lease what is due and load it (None: nothing to do yet)."""
        wanted = self.ready()
        if not wanted:
            return None
        self.policy.activate(self.adapter)
        lease = self.pool.lease(wanted, current_version=self.weights_of, tenant=self.tenant)
        return self.load(lease)

    # ---- persistence (the guard's side: `guarded.GuardSide`) -------------------------------------
    def save(self, lease_ids: list[str] | tuple[str, ...] = (), whole: tuple[dict, dict] | None = None) -> None:
        """Rank 0 writes the checkpoint: every rank holds the same state, or (sharded) `whole` is
        what `sharded.gather` collected from all of them."""
        if not self.ranks.lead:
            return
        checkpoint.save(checkpoint.path_of(self.root, self.tenant), self.policy, self.optimizer,
                        {"step": self.step_count, "version": self.version, "lease_ids": list(lease_ids),
                         "promoted": self.promoted, "rollbacks": self.rollbacks,
                         "reward_baseline": self.reward_baseline, "weights_of": self.weights_of,
                         "rejections": self.rejections}, whole)

    def load(self, lease: Any) -> list[TrainSample]:
        samples = load_samples(self.pool, lease)
        distill = self.config.memory.distill_weight if self.tc.method != "rl" else 0.0  # (OPD's machinery)
        return per_sample(samples + relabelled(self.pool, samples, self.tc.relabel)
                          + consolidate.rows(self.policy.chat, samples, distill), self.tc)

    def check_memory(self, gaps: dict[int, dict[str, Any]], measured_on: int) -> dict[str, list[int]]:
        """Rank 0, after the verdict: the memory entries' consolidation measures (`consolidate.check`)."""
        return consolidate.check(self.policy, self.pool, self.config, self.tc, self.tenant, gaps, measured_on,
                                 self.promoted)

    def train_step(self, samples: list[TrainSample]) -> dict[str, Any] | None:
        """Forward/backward on `samples`, adding to the gradients kept since the last optimizer step;
        then, once a version is due (`version_due`), that step. Returns the step's metrics, or None
        while the version accumulates (only with `trainer.min_samples`: without it every call with
        samples is one step).

        Each micro-batch's loss is its token mean, backpropagated times its token count, and the sum
        is divided by the total before the step: the step follows the token mean over everything
        accumulated, however it was cut into micro-batches (`micro_batches`: by a token budget)
        and leases."""
        if samples:
            if self.accumulated is None:
                self.optimizer.zero_grad(set_to_none=True)
                self.accumulated = Accumulated(opened=accumulate.clock())
            acc = self.accumulated
            rl, self.reward_baseline = rl_advantages(samples, self.tc, self.reward_baseline)  # batch-wide
            mine = self.ranks.share([len(s.step.prompt_ids) + len(s.step.token_ids) for s in samples])
            own = [samples[i] for i in mine]
            passes = micro_batches(own, self.tc.micro_batch_tokens, self.tc.micro_batch)
            # Every forward/backward of a sharded layer is a collective: agree first on the most passes.
            busiest = self.ranks.most(len(passes)) if self.sharded else len(passes)
            for index in passes:
                t0 = time.perf_counter()
                try:
                    m = prepare(self.policy, [own[i] for i in index], self.tc, rl[[mine[i] for i in index]])
                    t1 = time.perf_counter()
                    if m.stats["tokens"]:
                        loss, stats = self.loss(m)
                        (loss * m.stats["tokens"]).backward()
                except torch.OutOfMemoryError as exc:
                    if self.ranks.world > 1:  # the others wait in a collective: the group restarts, and
                        raise  # the lease's expiry counts against its samples (`pool.max_lease_attempts`)
                    why = f"out of memory: {str(exc).splitlines()[0]}"
                    del exc  # (its traceback holds the pass's tensors)
                    # (a relabelled row's own id names no lease: its sample's does)
                    suspects = {own[i].step.step_id.removesuffix(":relabelled").removesuffix(MEMORY_SUFFIX)
                                for i in index}
                    self.give_back(acc.samples + samples, suspects, why)
                    return None
                if m.stats["tokens"]:
                    acc.count({key: stats.pop(key) for key in HINTED_SUMS if key in stats})
                    acc.add(stats, m.stats["tokens"])
                elif self.sharded:
                    self.empty_pass()
                acc.count(m.stats)
                add_gaps(acc.memory_gaps, m.memory_gaps)
                if self.tc.epochs > 1:  # kept only to be passed over again
                    acc.passes.append(m)
                acc.prepare_s, acc.train_s = acc.prepare_s + t1 - t0, acc.train_s + time.perf_counter() - t1
            for _ in range(busiest - len(passes)):  # (sharded only) as many passes as the busiest rank
                self.empty_pass()
                if self.tc.epochs > 1:
                    acc.passes.append(None)
            acc.samples += samples
        acc = self.accumulated
        if not self.ranks.broadcast(acc is not None and version_due(acc, self.tc, self.config.pool.lease_seconds)):
            return None  # (rank 0's clock decides for every rank)

        assert acc is not None
        self.accumulated = None
        acc.counts, acc.sums = self.ranks.sum_dicts(acc.counts), self.ranks.sum_dicts(acc.sums)  # every rank's
        if self.ranks.world > 1:
            gaps: dict[int, dict[str, Any]] = {}
            for part in self.ranks.gather(acc.memory_gaps):
                add_gaps(gaps, part)
            acc.memory_gaps = gaps
        if not acc.tokens:  # nothing to step on: `run_once` acknowledges it without a version
            return {**acc.metrics(), "step": self.step_count}
        t = time.perf_counter()
        lr, grad_norm = self.optimizer_step(acc.tokens)
        if not math.isfinite(grad_norm):  # nothing moved: the leases go back, the culprit to be found out
            self.give_back(acc.samples, {s.step.step_id for s in acc.samples}, f"gradient norm {grad_norm}")
            return None
        later = [self.epoch(acc) for _ in range(self.tc.epochs - 1)]  # PPO's further passes over the batch
        acc.train_s += time.perf_counter() - t
        return {"step": self.step_count, **acc.metrics(), "grad_norm": grad_norm, "lr": lr,
                "memory_gaps": acc.memory_gaps,
                "reward_baseline": self.reward_baseline, "epochs": self.tc.epochs,
                **({f"last_{key}": value for key, value in later[-1].items()} if later else {}),
                "staleness": sum(self.weights_of - s.step.policy_version for s in acc.samples) / len(acc.samples)}

    def optimizer_step(self, tokens: float) -> tuple[float, float]:
        """Step on the gradients kept (every rank's, summed) as their token mean over `tokens`.
        Returns the learning rate and the gradient norm before clipping; a norm that is not finite
        skips the step (counted as `nonfinite_steps`, logged)."""
        # Counted on the optimizer's own steps: a reset to a fresh optimizer (a rollback to the
        # base) warms up again, as its first Adam step moves every parameter by the full lr. After
        # rejected candidates in a row, smaller (`trainer.reject_backoff`): see `apply_verdict`.
        lr = scheduled_lr(self.tc, optimizer_steps(self.optimizer) + 1) * self.tc.reject_backoff ** self.rejections
        self.ranks.sum_gradients(self.policy.parameters())  # the sum over every rank's samples, on each
        for param in self.policy.parameters():
            if param.grad is not None:
                param.grad.div_(tokens)
        grad_norm = (sharded.clip_gradients(self.policy.parameters(), self.tc.grad_clip) if self.sharded
                     else float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.tc.grad_clip)))
        if not math.isfinite(grad_norm):  # (every rank sees the same summed norm: all skip alike)
            # One NaN in the gradients makes every weight NaN after the step: a broken version
            # published (with the guard off, served) and trained on for good. So no step.
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_steps += 1
            log.warning("gradient norm %s: optimizer step skipped, weights unchanged (%d such steps so far)",
                        grad_norm, self.nonfinite_steps)
            return lr, grad_norm
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.tc.teacher == "ema":
            self.policy.update_ema(self.tc.ema_decay)
        self.step_count += 1
        return lr, grad_norm

    def epoch(self, acc: Accumulated) -> dict[str, float]:
        """One more optimizer step on the version's samples (`trainer.epochs`): their prepared
        passes again (advantages, behaviour logprobs and teacher kept), the loss recomputed under
        the moved policy, so the clip holds each token near the sampler. Returns this pass's token
        means of the loss's metrics: how far the batch has moved (`ratio`, `clip_frac`, `kl_base`)."""
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for m in acc.passes:
            if m is None or not m.stats["tokens"]:
                if self.sharded:
                    self.empty_pass()
                continue
            loss, stats = self.loss(m)
            (loss * m.stats["tokens"]).backward()
            for key, value in stats.items():
                if key not in HINTED_SUMS:
                    sums[key] = sums.get(key, 0.0) + value * m.stats["tokens"]
        mine = sum(m.stats["tokens"] for m in acc.passes if m is not None)
        sums = {key: value / mine for key, value in sums.items()} if mine else {}  # this rank's means
        _, sums["grad_norm"] = self.optimizer_step(acc.tokens)
        return sums

    def loss(self, m: Prepared) -> tuple[torch.Tensor, dict[str, float]]:
        """A micro-batch's objective (token means over `m.mask`) and its drift metrics, measured on
        the policy before the update: the PPO surrogate, plus the entropy band (`entropy_coef`) and
        the KL penalty to the base model (`kl_coef`, measured by `kl_estimator`). One fused pass of
        the head (`Policy.stats`) gives the logprobs, entropies and KLs, in chunks of positions.

        Metrics: `entropy` and `kl_base` (KL(policy || base)), both per token over the whole
        vocabulary; `kl_teacher` (`opd_estimator = "full"`), KL(policy || hinted teacher) on the
        hinted samples' tokens; `kl_sampler`, KL(sampler || learner) on the sampled tokens (the logprobs the
        engine stored against the learner's: more than ~0 on fresh samples means off-policy data or
        a mismatch between the engine's maths and the trainer's); `kl`, the penalty's KL (0 when off)."""
        reference = self.policy.has_base and (self.tc.kl_coef > 0 or (
            self.tc.kl_base_every > 0 and self.step_count % self.tc.kl_base_every == 0))
        logp, entropies, kls, kl_teacher, logp_stop, base_logp = self.policy.stats(
            m.rows, m.mask, reference=reference, teacher=m.teacher, teacher_head=m.teacher_head,
            stop=m.stop_teacher is not None)
        loss, stats = ppo_loss(logp, m.behaviour, m.advantage, m.mask, self.tc.eps_low, self.tc.eps_high,
                               self.tc.dual_clip)
        if m.distill is not None:  # `opd_estimator = "full"`: OPD as the KL to the hinted teacher itself
            weight = self.tc.w_opd if self.tc.method == "combine" else 1.0
            loss = loss + weight * (kl_teacher * m.distill).sum() / m.mask.sum().clamp(min=1)
        kl_stop = None
        if m.stop_teacher is not None:  # `stop_coef`: the hinted teacher's stop decision at every position
            kl_stop = stop_kl(m.stop_teacher, logp_stop) * m.stop_weight
            loss = loss + self.tc.stop_coef * kl_stop.sum() / m.mask.sum().clamp(min=1)
        entropy = masked_mean(entropies, m.mask)
        if self.tc.entropy_coef > 0:
            loss = loss + self.tc.entropy_coef * entropy_band(entropy, self.tc.entropy_min, self.tc.entropy_max)
        # The metrics as tensors, read back in one transfer: on a GPU each `float()` or `.item()`
        # waits for the device, and a dozen of them per micro-batch stalled its queue as often.
        metrics = {"ratio": stats["ratio"], "clip_frac": stats["clip_frac"],
                   # sums, not a token mean: `train_step` counts them over the hinted tokens only
                   **({"kl_teacher_sum": (kl_teacher.detach() * m.distill).sum(),
                       "distill_tokens": m.distill.sum()} if m.distill is not None else {}),
                   **({"kl_stop_sum": kl_stop.detach().sum(), "stop_tokens": m.stop_weight.sum(),
                       "p_stop_sum": (logp_stop.detach().exp() * m.stop_weight).sum(),
                       "p_stop_teacher_sum": (m.stop_teacher.exp() * m.stop_weight).sum()}
                      if kl_stop is not None else {}),
                   "adv_mean": masked_mean(m.advantage, m.mask), "entropy": entropy.detach(),
                   "kl_sampler": kl_to_reference(m.behaviour, logp.detach(), m.sampled)}
        kl = torch.zeros((), device=logp.device)
        if reference:  # always with LoRA but for `kl_base_every`; full fine-tuning: only for kl_coef / teacher
            kl_base = masked_mean(kls, m.mask)
            metrics["kl_base"] = kl_base.detach()
            if self.tc.kl_coef > 0:
                # k3 on the sampled tokens: the base's logprobs come from the base pass above
                kl = kl_base if self.tc.kl_estimator == "full" else kl_to_reference(logp, base_logp, m.mask)
                loss = loss + self.tc.kl_coef * kl
        metrics.update(loss=loss.detach(), kl=kl.detach())
        values = torch.stack([torch.as_tensor(v, device=logp.device).detach().float().reshape(()) for v in metrics.values()])
        return loss, dict(zip(metrics, values.tolist()))

    def give_back(self, samples: list[TrainSample], suspects: set[str], why: str) -> None:
        """The version in the making failed (`why`: out of memory, a non-finite gradient): its
        gradients are dropped and its leases given back at once, each of `suspects` (step ids)
        counting a failed attempt; one that keeps failing is dropped as `poison` by the pool
        (`pool.max_lease_attempts`), so the trainer lives on and no sample fails forever."""
        self.accumulated = None
        self.optimizer.zero_grad(set_to_none=True)
        if self.policy.device.type == "cuda":
            torch.cuda.empty_cache()  # what the failed pass held goes back to the device
        self.failed_versions += 1
        leases = list(dict.fromkeys(s.lease_id for s in samples if s.lease_id))
        log.warning("training failed (%s): %d lease(s) given back, %d sample(s) charged an attempt (%d failed so far)",
                    why, len(leases), len(suspects), self.failed_versions)
        for lease_id in leases if self.ranks.lead else ():
            self.pool.release(lease_id, dict.fromkeys(suspects, why))

    def empty_pass(self) -> None:
        """A forward/backward through the sharded layers that adds nothing to the gradients: a rank
        with fewer micro-batches than another (or one without a trainable token) still joins each
        of their collectives."""
        rows = pack([[self.policy.pad_id]], [[self.policy.pad_id]], [1.0], self.policy.pad_id)
        logp = self.policy.stats(rows, rows.mask, reference=False)[0]
        (logp.sum() * 0.0).backward()

    @torch.no_grad()
    def sequence_logprob(self, prompt_ids: list[int], reply_ids: list[int], temperature: float = 1.0) -> float:
        """Sum of the policy's logprobs of a reply (for tests and the demo's probes)."""
        return float(self.policy.logprobs(pack([prompt_ids], [reply_ids], [temperature], self.policy.pad_id)).sum())

    # ---- metrics -------------------------------------------------------------------------------
    def log(self, metrics: dict[str, Any]) -> None:
        """The version's metrics: the trainer's own log (JSONL, TensorBoard, W&B), and the pool's
        version log, where the dashboard reads them wherever the trainer runs (another host, Ray)."""
        if self.history is not None:
            self.history.write(metrics, self.step_count)
            history.record_in_pool(self.pool, self.adapter, metrics)

    def close(self) -> None:
        if self.history is not None:
            self.history.close()

    def run(self, stop: Any) -> None:
        """Train until `stop.is_set()`; idle polls are cheap reads."""
        train_until(self, stop, self.ranks, self.tc.poll_s)


def train_until(trainer: Any, stop: Any, ranks: Ranks | None = None, poll_s: float = 0.5,
                on_version: Callable[[dict[str, Any]], None] | None = None) -> None:
    """The trainer's outer loop, the one every trainer process runs (`clawr1 train`, the Ray
    trainer actors, `Trainer.run`): `trainer.run_once()` (a `Trainer`, `TenantTrainers` or
    `TinkerTrainer`), an idle wait of `poll_s` when it made no version, until `stop` (an Event) is
    set. With ranks, rank 0 decides when every rank stops (a rank leaving alone would hang the
    others) and only it reports versions to `on_version(metrics)`."""
    ranks = ranks or Ranks()
    while not ranks.broadcast(stop.is_set()):
        metrics = trainer.run_once(stop)
        if metrics is None:
            if ranks.lead:
                stop.wait(poll_s)
            continue
        if ranks.lead and on_version is not None:
            on_version(metrics)
