"""White-box offline mode (`clawr1 train-flow`): a Python flow, G rollouts per task, GRPO.

Each round, flat:

1. roll out G sessions per task of the round at once, all G sharing the task's group (prompt) id,
   through the real gateway (in this process, with the reward worker), and close each session
   with its outcome;
2. wait until the reward worker has judged every intermediate turn of the round (the last turn's
   reward is the outcome; with `reward.step_weight` > 0 earlier turns mix in the outcome too);
3. one optimizer step over everything READY, with the existing `Trainer`. The batch is the whole
   round, so no group is split and `trainer/batch.py`'s per-prompt-id normalisation sees every
   rollout of a group (rewards of 0 are masked by the pool, so use outcomes of +-1);
4. wait until the gateway serves the new version, so the next round is sampled on-policy.

The trainer runs in this process, not as `clawr1 train`: rounds are synchronous (rollout, then
train), and nothing would overlap for a second process to gain.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import openai
from rich.console import Console
from rich.progress import Progress

from clawr1.core.config import Config
from clawr1.core.records import POLICY
from clawr1.entrypoints.inprocess import Served, serve_in_process, wait_judged
from clawr1.envs.base import Task
from clawr1.flows.base import AgentFlow
from clawr1.flows.evaluate import TaskEval, evaluate_tasks, grouped, mistakes_text
from clawr1.flows.rollouts import NO_KEY, Rollout, RolloutResult, close_session, new_run_id, plan, rollout_url
from clawr1.reward.types import Judge
from clawr1.trainer.loop import Trainer

MAX_BATCH = 4096  # `trainer.batch_size`'s bound: beyond it a round's rest waits READY for the next step
SWAP_TIMEOUT_S = 120.0


@dataclass
class TrainFlowResult:
    run_id: str
    rollouts: list[RolloutResult] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)  # the trainer's metrics per step
    version: int = 0  # the newest policy version published
    curve: list[dict[str, Any]] = field(default_factory=list)  # held-out success and sane rate per version evaluated


def rounds_of(tasks: list[Task], epochs: int, steps: int | None, tasks_per_step: int | None) -> list[list[Task]]:
    """The tasks of each round: `tasks_per_step` at a time (default all), `epochs` passes over the
    set, or exactly `steps` rounds cycling over it when given."""
    if not tasks:
        raise ValueError("no tasks")
    per = tasks_per_step or len(tasks)
    if per < 1 or epochs < 1 or (steps is not None and steps < 1):
        raise ValueError("tasks_per_step, epochs and steps must be >= 1")
    chunks = [tasks[i:i + per] for i in range(0, len(tasks), per)]
    count = steps if steps is not None else epochs * len(chunks)
    return [chunks[i % len(chunks)] for i in range(count)]


def run_rollout(flow: AgentFlow, served: Served, rollout: Rollout) -> RolloutResult:
    """One rollout: the flow with a client bound to the rollout's session, then the close."""
    started = time.perf_counter()
    client = openai.OpenAI(base_url=rollout_url(served.root, rollout), api_key=served.api_key or NO_KEY)
    try:
        outcome = flow.run(rollout.task, client)
    except BaseException:
        close_session(served.root, rollout.session_id, None, served.api_key)  # masked, then the error goes on
        raise
    closed = close_session(served.root, rollout.session_id, outcome, served.api_key)
    return RolloutResult(rollout.task.id, rollout.index, rollout.session_id, rollout.prompt_id, outcome,
                         closed["turns"] if closed else 0, "ok" if closed else "no calls",
                         time.perf_counter() - started)


def wait_served(served: Served, version: int) -> None:
    """Until the gateway serves policy `version` (it polls the adapter store)."""
    deadline = time.monotonic() + SWAP_TIMEOUT_S
    while served.engine.adapters().get(POLICY, 0) < version:
        served.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gateway did not load policy v{version} within {SWAP_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def train_flow(config: Config, flow: AgentFlow, tasks: list[Task], *, group: int = 4, epochs: int = 1,
               steps: int | None = None, tasks_per_step: int | None = None, concurrency: int = 8,
               judge: Judge | None = None, judge_timeout_s: float = 600.0,
               heldout: list[Task] | None = None, eval_every: int = 4,
               console: Console | None = None) -> TrainFlowResult:
    """Roll out, judge and train, round by round (see the module docstring).

    Args:
        group: G, rollouts per task and round (one GRPO group).
        epochs: passes over the tasks (ignored when `steps` is given).
        steps: exactly this many rounds, each one optimizer step.
        tasks_per_step: tasks per round (default all).
        concurrency: rollouts running at once.
        judge: replaces the configured judge (tests).
        heldout: tasks evaluated (as side turns, never trained) before the first round, every
            `eval_every` versions and after the last: the curve, with the base's runs as reference.
    Returns:
        Every rollout's result, the trainer's metrics per step, the newest version.
    """
    console = console or Console(stderr=True)
    if config.trainer.backend != "local":
        raise ValueError("train-flow trains in this process (trainer.backend = \"local\"); a tinker backend "
                         "learns from black-box traffic through `clawr1 up`")
    rounds = rounds_of(tasks, epochs, steps, tasks_per_step)
    if heldout is not None and (not heldout or eval_every < 1):
        raise ValueError("heldout needs at least one task and eval_every >= 1")
    result = TrainFlowResult(new_run_id("wb"))
    # Offline rounds are the flow's own traffic, in GRPO groups a probe set would break up, and the
    # runner measures each version's success itself: every version is served for the next round.
    config = config.model_copy(deep=True)
    config.guard.enabled = False
    train_config = config.model_copy(deep=True)
    train_config.trainer.max_wait_s = 0.0  # a round's samples are all there: train now
    train_config.trainer.batch_size = MAX_BATCH  # the whole round in one step, groups intact
    with serve_in_process(config, judge=judge) as served:
        with console.status("Loading the trainer's policy ..."):
            trainer = Trainer(train_config, served.pool)
        wait_served(served, trainer.version)  # a resumed run continues from its newest version
        result.version = trainer.version
        reference = _evaluate(served, heldout, None, result, console) if heldout else None
        with Progress(console=console, transient=True) as progress, ThreadPoolExecutor(max(1, concurrency)) as pool:
            for n, round_tasks in enumerate(rounds, 1):
                rollouts = plan(round_tasks, group, result.run_id, n)
                bar = progress.add_task(f"round {n}/{len(rounds)}: rollouts", total=len(rollouts))
                futures = [pool.submit(run_rollout, flow, served, r) for r in rollouts]
                for future in futures:
                    result.rollouts.append(future.result())
                    progress.advance(bar)
                progress.update(bar, description=f"round {n}/{len(rounds)}: judging")
                wait_judged(served, [r.session_id for r in rollouts], judge_timeout_s)
                progress.update(bar, description=f"round {n}/{len(rounds)}: training")
                metrics = trainer.run_once()
                progress.remove_task(bar)
                if metrics is None:
                    console.print(f"round {n}: nothing READY to train on (all outcomes 0 or undecided?)")
                    continue
                result.steps.append(metrics)
                result.version = metrics["version"]
                done = result.rollouts[-len(rollouts):]
                mean = [r.outcome for r in done if r.outcome is not None]
                console.print(f"round {n}: {len(rollouts)} rollouts, outcome "
                              f"{sum(mean) / len(mean) if mean else float('nan'):+.2f}; v{metrics['version']}: "
                              f"{metrics['lease']} samples, loss {metrics['loss']:+.4f}, {metrics['total_s']:.1f} s")
                wait_served(served, metrics["version"])
                if heldout and (metrics["version"] % eval_every == 0 or n == len(rounds)):
                    _evaluate(served, heldout, reference, result, console)
        trainer.close()
    return result


def _evaluate(served: Served, tasks: list[Task], reference: TaskEval | None, result: TrainFlowResult,
              console: Console) -> TaskEval:
    """One point of the held-out curve, printed and appended to `result.curve`."""
    evaluation = evaluate_tasks(served.root, served.api_key or NO_KEY, tasks, reference=reference)
    numbers = grouped(evaluation.served)
    point = {"version": result.version, "success": numbers["success"], "ci95": numbers["ci95"],
             "sane_rate": numbers["sane_rate"], "tool_error_share": numbers["tool_error_share"],
             "mistakes_per_call": numbers["mistakes_per_call"],
             "by_family": {f: s["success"] for f, s in numbers["by_family"].items()},
             "by_level": {f: s["success"] for f, s in numbers["by_level"].items()},
             "quality_error": evaluation.quality_error, "runs": [asdict(r) for r in evaluation.served]}
    result.curve.append(point)
    sane = "-" if point["sane_rate"] is None else f"{point['sane_rate']:.2f}"
    console.print(f"held-out v{result.version}: success {point['success']:.2f} "
                  f"[{point['ci95'][0]:.2f}, {point['ci95'][1]:.2f}] over {numbers['n']} tasks, sane {sane}; "
                  f"per model call: {mistakes_text(numbers)}")
    return evaluation
