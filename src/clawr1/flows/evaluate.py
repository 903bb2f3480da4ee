"""Held-out task evaluation of whatever version a gateway serves now, beside the base model.

Every task runs once through the tool-agent loop against the gateway as *side* turns
(`X-Turn-Type: side`: recorded, never trained), once on the served version and once on the base
(`X-Policy-Version: 0`) unless the served version is the base. Success rates come per family and
per level with a 95% Wilson interval, so two versions are only called different when the
intervals say so. Beside them, the quality measure of the learning loop: each rollout's last reply
is measured with `POST /v1/quality` against the base's last replies, so a version that wins by
degenerate output shows it in its sane rate; and the share of tool calls that came back as errors.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import openai

from clawr1.envs.base import Task
from clawr1.flows.tool_agent import ToolAgentFlow

BASE = "clawr1-v0"
MAX_IDS = 512  # what `POST /v1/quality` takes at once
MISTAKES = ("unparsed_call", "wrong_tool", "bad_arguments")


@dataclass(frozen=True)
class TaskRun:
    """One task's rollout on one version, verbatim enough to read."""

    task_id: str
    family: str
    level: int | None
    solved: bool
    final: str
    turns: int
    tool_calls: int
    tool_errors: int
    completion_id: str
    version: str
    sane: bool | None = None
    reasons: tuple[str, ...] = ()
    mistakes: dict[str, int] = field(default_factory=dict)  # `Episode.mistakes`


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of k successes in n (95% at the default z); (0, 1) for n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z * z / n)), min(1.0, (centre + half) / (1 + z * z / n))


def stats(runs: Sequence[TaskRun]) -> dict[str, Any]:
    """Success rate with its interval, sane rate (None when unmeasured), tool-error share, turns."""
    n, k = len(runs), sum(r.solved for r in runs)
    measured = [r for r in runs if r.sane is not None]
    calls, turns = sum(r.tool_calls for r in runs), sum(r.turns for r in runs)
    lo, hi = wilson(k, n)
    return {"n": n, "solved": k, "success": k / n if n else 0.0, "ci95": [lo, hi],
            "sane_rate": sum(bool(r.sane) for r in measured) / len(measured) if measured else None,
            "tool_calls_per_task": calls / n if n else 0.0,
            "tool_error_share": sum(r.tool_errors for r in runs) / calls if calls else None,
            "turns": sum(r.turns for r in runs) / n if n else 0.0,
            # the form failures a model call made, as a share of all model calls
            "mistakes_per_call": {kind: sum(r.mistakes.get(kind, 0) for r in runs) / turns if turns else 0.0
                                  for kind in MISTAKES},
            "versions": dict(collections.Counter(r.version for r in runs))}


def mistakes_text(numbers: dict[str, Any]) -> str:
    """`stats`' form failures per model call, as one line prints them."""
    return ", ".join(f"{kind} {share:.2f}" for kind, share in numbers["mistakes_per_call"].items())


def grouped(runs: Sequence[TaskRun]) -> dict[str, Any]:
    """`stats` overall, per family and per (family, level)."""
    fams: dict[str, list[TaskRun]] = collections.defaultdict(list)
    levels: dict[str, list[TaskRun]] = collections.defaultdict(list)
    for r in runs:
        fams[r.family].append(r)
        if r.level is not None:  # a family task; a task file's have none
            levels[f"{r.family} L{r.level}"].append(r)
    return {**stats(runs), "by_family": {f: stats(rs) for f, rs in sorted(fams.items())},
            "by_level": {f: stats(rs) for f, rs in sorted(levels.items())}}


def run_tasks(client: openai.OpenAI, tasks: Sequence[Task], flow: ToolAgentFlow, *, concurrency: int = 4,
              progress: Callable[[], None] | None = None) -> list[TaskRun]:
    """Each task once through `flow` on `client` (whose default headers pick the version)."""

    def one(task: Task) -> TaskRun:
        ep = flow.episode(task, client)
        if progress:
            progress()
        return TaskRun(task_id=task.id, family=str(task.meta.get("family", task.env)), level=task.meta.get("level"),
                       solved=ep.outcome > 0, final=ep.final, turns=ep.turns, tool_calls=ep.tool_calls,
                       tool_errors=ep.tool_errors, completion_id=ep.last_id, version=ep.version,
                       mistakes=ep.mistakes)

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return list(pool.map(one, tasks))


@dataclass(frozen=True)
class TaskEval:
    """The served version's runs and the base's on the same tasks, with the quality verdicts."""

    served: list[TaskRun]
    base: list[TaskRun]
    calibration: dict[str, Any] | None = None
    quality_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"served": grouped(self.served), "base": grouped(self.base), "calibration": self.calibration,
                "quality_error": self.quality_error, "runs": [asdict(r) for r in self.served],
                "base_runs": [asdict(r) for r in self.base]}


def evaluate_tasks(base_url: str, api_key: str, tasks: Sequence[Task], *, max_turns: int = 6,
                   max_tokens: int | None = 128, temperature: float = 0.7, concurrency: int = 4,
                   reference: TaskEval | None = None, progress: Callable[[], None] | None = None) -> TaskEval:
    """Run `tasks` on the served version and on the base, and measure the last replies.
    `reference`: an earlier evaluation of the same tasks whose base runs are reused (a curve asks
    the base once)."""

    def client(base: bool) -> openai.OpenAI:
        headers = {"X-Turn-Type": "side"} | ({"X-Policy-Version": "0"} if base else {})
        return openai.OpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key=api_key, max_retries=0, timeout=600,
                             default_headers=headers)

    flow = ToolAgentFlow(max_turns=max_turns, max_tokens=max_tokens, temperature=temperature, model="clawr1")
    if reference is not None and [r.task_id for r in reference.base] != [t.id for t in tasks]:
        raise ValueError("the reference evaluation ran other tasks")
    with client(False) as served_client:
        served = run_tasks(served_client, tasks, flow, concurrency=concurrency, progress=progress)
        if reference is not None:
            base = reference.base
        elif all(r.version == BASE for r in served):
            base = served
        else:
            with client(True) as base_client:
                base = run_tasks(base_client, tasks, flow, concurrency=concurrency, progress=progress)
        try:
            measured, calibration = _measure(served_client, served, base)
            if base is served:
                return TaskEval(measured, measured, calibration)
            if base[0].sane is None:
                base = _measure(served_client, base, base)[0]
            return TaskEval(measured, base, calibration)
        except openai.APIError as exc:  # e.g. too few non-empty base replies to calibrate on, a timeout: the runs
            # are kept (minutes of model calls), and the error is printed with them
            return TaskEval(served, base, None, f"replies not measured: {exc.message}")


def _measure(client: openai.OpenAI, runs: list[TaskRun], base: list[TaskRun]) -> tuple[list[TaskRun], Any]:
    """`runs` with the quality verdicts of their last replies, judged by the base's last replies
    (in chunks the endpoint takes; the calibration is computed once and reused)."""
    refs, out, calibration = [r.completion_id for r in base][:MAX_IDS], [], None
    for i in range(0, len(runs), MAX_IDS):
        chunk = runs[i:i + MAX_IDS]
        answer = client.post("/quality", cast_to=dict, body={
            "completion_ids": [r.completion_id for r in chunk], "reference_ids": refs})
        out += [replace(r, sane=m["sane"], reasons=tuple(m["reasons"])) for r, m in zip(chunk, answer["data"])]
        calibration = answer["calibration"]
    return out, calibration
