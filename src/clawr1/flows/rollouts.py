"""What both offline modes share: rollout ids, the per-rollout base URL, closing a session with
its outcome over HTTP (as any client would), and the results table.

Ids: a run has a short random id; the G rollouts of one task in one round share the prompt id
`<run>-<task>-<round>` (their GRPO group) and each has its own session id `<prompt id>-r<k>`.
"""

from __future__ import annotations

import re
import statistics
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from rich.table import Table

from clawr1.core.config import Config
from clawr1.envs.base import Env, Task

EnvFactory = Callable[[Task], Env]
NO_KEY = "clawr1-local"  # OpenAI clients insist on some key; a gateway without keys ignores it


@dataclass(frozen=True)
class Rollout:
    task: Task
    index: int  # k in 0..G-1 within its group
    session_id: str
    prompt_id: str


@dataclass
class RolloutResult:
    task_id: str
    rollout: int
    session_id: str
    prompt_id: str
    outcome: float | None
    turns: int  # main turns the gateway recorded for the session
    status: str  # ok | timeout | exit N | no calls
    seconds: float
    detail: str = ""  # e.g. the agent's last stderr lines when it failed

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def env_for(config: Config) -> EnvFactory:
    """The env a task names (`task.env`), from the envs registry."""
    def make(task: Task) -> Env:
        from clawr1.envs import make_env  # the registry is imported only when a task needs it

        return make_env(task.env, config)
    return make


def new_run_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _safe(text: str) -> str:
    """A task id as one URL path segment (the gateway reads ids from the path)."""
    return re.sub(r"[^A-Za-z0-9_.:-]+", "_", text)[:80] or "_"


def plan(tasks: list[Task], group: int, run_id: str, round_index: int) -> list[Rollout]:
    """G rollouts per task, grouped by task (a group's sessions share its prompt id)."""
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    out = []
    for n, task in enumerate(tasks):
        prompt_id = f"{run_id}-{n}-{_safe(task.id)}-{round_index}"
        out += [Rollout(task, k, f"{prompt_id}-r{k}", prompt_id) for k in range(group)]
    return out


def gateway_root(url: str) -> str:
    """`http://host:port` from what a user may pass (`.../v1`, a trailing slash)."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def rollout_url(root: str, rollout: Rollout) -> str:
    """The OpenAI base URL that records every call into the rollout's session and group."""
    return f"{root}/{rollout.session_id}/{rollout.prompt_id}/v1"


def agent_key(root: str, session_id: str, api_key: str | None, timeout_s: float = 60.0) -> str:
    """The key an external agent gets for its rollout's session (`POST /v1/sessions`): it serves that
    session only and cannot rate it (no feedback, no close), so the agent cannot score its own turns;
    the runner keeps `api_key` to close the session with the task's outcome. A gateway without keys
    (`api_key` None) trusts every local process anyway: the agent gets the placeholder."""
    if not api_key:
        return NO_KEY
    response = httpx.post(f"{root}/v1/sessions", json={"session_id": session_id}, timeout=timeout_s,
                          headers={"Authorization": f"Bearer {api_key}"})
    response.raise_for_status()
    return response.json()["api_key"]


def close_session(root: str, session_id: str, outcome: float | None, api_key: str | None,
                  timeout_s: float = 60.0) -> dict[str, Any] | None:
    """`POST /v1/sessions/{id}/close` with the outcome (None: no reward, the last turn is masked).

    Returns:
        The gateway's answer (`was_open`, `turns`, ...), or None when the session was never
        opened (no key was made for it and the agent never asked the model).
    Raises:
        httpx.HTTPStatusError: any other refusal (bad outcome, auth).
    """
    body = {} if outcome is None else {"outcome_reward": outcome}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.post(f"{root}/v1/sessions/{session_id}/close", json=body, headers=headers, timeout=timeout_s)
    if response.status_code == 404:
        return None
    response.raise_for_status()
    return response.json()


def results_table(results: list[RolloutResult], title: str) -> Table:
    table = Table("task", "rollout", "outcome", "turns", "status", "seconds", title=title)
    for r in results:
        outcome = "-" if r.outcome is None else f"{r.outcome:+.2f}"
        table.add_row(r.task_id, str(r.rollout), outcome, str(r.turns), r.status, f"{r.seconds:.1f}")
    return table


def summary(results: list[RolloutResult]) -> dict[str, Any]:
    """Numbers over a run: rollouts, mean outcome, solved share (outcome > 0), mean turns."""
    decided = [r.outcome for r in results if r.outcome is not None]
    return {"rollouts": len(results), "decided": len(decided),
            "mean_outcome": statistics.fmean(decided) if decided else None,
            "solved": sum(1 for o in decided if o > 0) / len(decided) if decided else None,
            "mean_turns": statistics.fmean(r.turns for r in results) if results else None}
