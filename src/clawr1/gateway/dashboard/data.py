"""What the dashboard shows, gathered in one place from the pool (which holds the trainer's
per-version metrics too, wherever the trainer runs) and the gateway.
The HTML panels and `GET /dashboard/api/summary` render the same dictionary, so a number on the
page is a number a script can read.

Definitions (also in docs/gateway.md, The dashboard):
- a version's *reward* is the mean reward of the main turns it served; the trainer's *batch reward*
  is the mean reward of the samples that trained it (served by earlier versions);
- its *preference score* is the share of its judged turns whose next state approved the reply
  (reward > 0) among those approved or corrected (reward < 0);
- *feedback-to-serving latency*: from a sample's reward arriving (it became READY) to the first
  reply recorded from the version trained on it; `publish` is the part up to its publication.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clawr1.core.records import DEFAULT_TENANT
from clawr1.engine import adapters as store

if TYPE_CHECKING:
    from clawr1.gateway.service import Gateway

# Trainer metrics shown per version (its row has more: see `clawr1/trainer/loop.py`).
TRAINED_FIELDS = ("loss", "reward_mean", "hint_rate", "clip_frac", "kl", "grad_norm", "tokens_per_s", "total_s",
                  "samples", "no_signal", "kl_silent",
                  "entropy", "kl_base", "sampler_kl", "verdict")
# The guard's verdict on each version, with the probe quality it was judged on (`engine/adapters.py`).
GUARD_FIELDS = ("status", "reason", "sane_rate", "relevance", "fluency", "kl", "entropy")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def versions(served: list[dict[str, Any]], trained: list[dict[str, Any]],
             ready: dict[str, list[float]], verdicts: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per policy version: what served it (pool) joined with what trained it (the trainer's row in the pool)
    and what the guard decided of it (its verdict and probe quality: `probe_*`)."""
    by_served = {row["version"]: row for row in served}
    by_trained = {m["version"]: m for m in trained if "version" in m}
    by_verdict = {v["version"]: v for v in verdicts or []}
    rows = []
    for version in sorted({0, *by_served, *by_trained, *by_verdict}):
        s, m, g = by_served.get(version, {}), by_trained.get(version, {}), by_verdict.get(version, {})
        judged = s.get("approved", 0) + s.get("corrected", 0)
        row: dict[str, Any] = {
            "version": version, "published_at": m.get("time"), "trained_on": m.get("lease"),
            **{key: m.get(key) for key in TRAINED_FIELDS},
            # Turns that left training unused since the version before, by why (`trainer/loop.py` LOST).
            "lost": {key[5:]: n for key, n in m.items() if key.startswith("lost_") and n} if m else None,
            "turns": s.get("turns", 0), "rewarded": s.get("rewarded", 0), "mean_reward": s.get("mean_reward"),
            "approved": s.get("approved", 0), "corrected": s.get("corrected", 0),
            "preference_score": s["approved"] / judged if judged else None,
            "first_served_at": s.get("first_served_at"), "latency_s": None, "latency_max_s": None, "publish_s": None,
            **{f"probe_{key}": g.get(key) for key in GUARD_FIELDS},
        }
        times = [t for lease in _leases(m) for t in ready.get(lease, [])]
        if times and row["first_served_at"] is not None:
            waits = [row["first_served_at"] - t for t in times]
            row["latency_s"], row["latency_max_s"] = _median(waits), max(waits)
        if times and row["published_at"] is not None:
            row["publish_s"] = _median([row["published_at"] - t for t in times])
        rows.append(row)
    return rows


def _leases(metrics: dict[str, Any]) -> list[str]:
    """The leases a version trained on (several when it accumulated small ones)."""
    return list(metrics.get("lease_ids") or ([metrics["lease_id"]] if metrics.get("lease_id") else []))


def judge_counts(gw: Gateway) -> dict[str, Any]:
    """The reward workers' tallies under `clawr1 up` (empty under `clawr1 serve`)."""
    outcomes: dict[str, int] = {}
    hints = errors = gave_up = 0
    for worker in gw.metrics.judges:
        for (score, source), n in worker.outcomes.items():
            key = f"{score:+d} {source}" if score else f"0 {source}"
            outcomes[key] = outcomes.get(key, 0) + n
        hints += worker.counts["hints"]
        errors += worker.counts["judge_errors"]
        gave_up += worker.counts["judge_gave_up"]
    return {"running": bool(gw.metrics.judges), "outcomes": dict(sorted(outcomes.items())), "hints": hints,
            "errors": errors, "gave_up": gave_up}


def summary(gw: Gateway, tenant: str | None = None, *,
            sessions: int = 25, samples: int = 25) -> dict[str, Any]:
    """Everything on the main page, of every tenant or one (`tenant`). Versions are those of the
    adapter the tenant is served: the shared policy, or with per-tenant adapters its own (the
    default tenant's when none is chosen). Runs off the event loop (it reads the pool)."""
    pool = gw.pool
    served_to = tenant or DEFAULT_TENANT
    adapter = gw.adapter_of(served_to)
    trained = pool.trained_versions(adapter)
    ready = pool.lease_ready_times([lease for m in trained for lease in _leases(m)])
    # With per-tenant adapters, a version number means something only within one tenant's line.
    serving = pool.versions(served_to if gw.per_tenant else tenant)
    return {
        "generated_at": time.time(),
        "model": gw.config.engine.model,
        "tenant": tenant,
        "tenants": [DEFAULT_TENANT, *sorted(gw.config.tenants.keys)],
        "adapter": adapter,
        "served_version": gw.served_version(served_to),
        "rejected_in_a_row": gw.guard.rejected_in_a_row.get(adapter, 0) if gw.guard is not None else 0,
        "gateway": {"inflight": gw.pending, "pending_writes": pool.pending_writes(),
                    "turns_by_how": gw.sessions.turns_by_how(tenant),
                    "swaps": [{"at": at, "adapter": name, "version": v, "load_s": s}
                              for at, name, v, s in gw.swaps if tenant is None or name == adapter][-20:]},
        "pool": pool.stats(tenant),
        "judge": judge_counts(gw),
        "versions": versions(serving, trained, ready, store.describe(Path(gw.config.data_dir) / "adapters", adapter)),
        "control": store.control(Path(gw.config.data_dir) / "adapters", adapter),
        "guard": gw.config.guard.model_dump() if gw.guard is not None and gw.guard.judging else None,
        "sessions": pool.sessions(limit=sessions, tenant=tenant),
        "samples": pool.samples(limit=samples, tenant=tenant),
        "memory": memory(gw, tenant),
    }


def memory(gw: Gateway, tenant: str | None, limit: int = 50) -> dict[str, Any]:
    """The per-user memory: the newest entries (with where each came from and its status), where it
    is off, and the entries this gateway never adds to a prompt (they hold a token of its model)."""
    config = gw.config.memory
    return {"enabled": config.enabled, "off_tenants": config.off_tenants, "fallback": config.fallback,
            "entries": gw.pool.memory(tenant=tenant, limit=limit), "off": gw.pool.memory_switches(tenant),
            "unsafe": {str(k): v for k, v in gw.memory.unsafe.items()}}


def session(gw: Gateway, session_id: str, tenant: str | None) -> dict[str, Any]:
    """One session, every turn with what the judge saw and decided: the request's last user
    message, the reply, the next state, rewards with votes and evidence, hints, failed judging
    attempts (and the give-up, with its reason), the sample's fate."""
    shown = gw.pool.show(session_id, tenant, "session")
    turns = []
    for turn in shown["steps"]:
        [step] = gw.pool.get_steps([turn["step_id"]])
        users = [m for m in step.messages if m.get("role") == "user"]
        turns.append({**turn, "context": users[-1].get("content") if users else None,
                      "next_state": step.next_state, "created_at": step.created_at, "memory": step.memory})
    return {**shown, "steps": turns}
