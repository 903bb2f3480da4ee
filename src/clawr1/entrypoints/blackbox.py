"""Black-box offline mode (`clawr1 run-agent -- CMD ...`): drive any external agent over a task set.

Per task and rollout: the env sets up its workspace (`env.reset`), CMD runs there as a subprocess
whose OpenAI settings point at the gateway with the rollout's session and group ids in the path,
so every call it makes is recorded and judged like production traffic. Its last non-empty stdout
line is its final answer; the env's checker turns that (and the workspace) into the outcome,
which closes the session over HTTP. The agent needs no code change: `openai` clients read
`OPENAI_BASE_URL` and `OPENAI_API_KEY` themselves. The agent never gets the runner's key: the model
behind it could post `/v1/feedback {"reward": 1}` on its own turns with it. It gets a key of its
session (`POST /v1/sessions`) that serves the session and cannot rate or close it.

What CMD gets besides its parent's environment:

| variable | value |
|---|---|
| `OPENAI_BASE_URL` | `<gateway>/<session_id>/<prompt_id>/v1` |
| `OPENAI_API_KEY` | a key for its own session only, which cannot rate it (a placeholder when the gateway needs none) |
| `CLAWR1_TASK` | the task as JSON |
| `CLAWR1_TASK_PROMPT` | the first user message (what `env.reset` returned) |
| `CLAWR1_WORKDIR` | the workspace, also its cwd |
| `CLAWR1_SESSION_ID`, `CLAWR1_PROMPT_ID` | its ids, e.g. for `POST /v1/feedback` |

A run that passes the wall-time limit is killed with its process group; its outcome is still what
the env's checker finds (the workspace is what it is).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress

from clawr1.core.config import Config
from clawr1.entrypoints.inprocess import serve_in_process, wait_judged
from clawr1.envs.base import Task
from clawr1.flows.rollouts import (
    EnvFactory,
    Rollout,
    RolloutResult,
    agent_key,
    close_session,
    env_for,
    gateway_root,
    new_run_id,
    plan,
    rollout_url,
)
from clawr1.reward.types import Judge

STDERR_TAIL = 800
KILL_GRACE_S = 2.0  # how long output may still come after the wall-time kill


def final_answer(stdout: str) -> str | None:
    """The agent's last non-empty stdout line."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    return lines[-1] if lines else None


def run_process(command: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> tuple[str, str, str]:
    """Run CMD in its own process group; returns (status, stdout, stderr), status `ok`, `exit N`
    or `timeout` (the whole group is killed then, so no grandchild outlives the rollout)."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = _after_kill(proc)
        return "timeout", out, err
    return ("ok" if proc.returncode == 0 else f"exit {proc.returncode}"), out, err


def _after_kill(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """What a killed run wrote. A grandchild that left the process group (`setsid`) escapes the
    kill and can hold the pipes open for as long as it lives, so the wait for their end is
    bounded; past it the pipes are closed on it and the output so far is what the run wrote."""
    try:
        return proc.communicate(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired as exc:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait()
        note = f"\n[a process that left the group still held the output open {KILL_GRACE_S:g} s after the kill]"
        return _decoded(exc.stdout), _decoded(exc.stderr) + note


def _decoded(data: bytes | str | None) -> str:
    """`TimeoutExpired` carries the raw bytes read so far, even from a text-mode `communicate`."""
    if isinstance(data, bytes):
        return data.decode("utf-8", errors="replace")
    return data or ""


def run_one(command: list[str], root: str, api_key: str | None, rollout: Rollout, make_env: EnvFactory,
            timeout_s: float) -> RolloutResult:
    started = time.perf_counter()
    task = rollout.task
    with make_env(task) as env, tempfile.TemporaryDirectory(prefix="clawr1-agent-") as scratch:
        prompt = env.reset(task)
        cwd = env.workdir or Path(scratch)  # never the runner's own directory
        key = agent_key(root, rollout.session_id, api_key)
        variables = {"OPENAI_BASE_URL": rollout_url(root, rollout), "OPENAI_API_KEY": key,
                     "CLAWR1_TASK": json.dumps(asdict(task), ensure_ascii=False), "CLAWR1_TASK_PROMPT": prompt,
                     "CLAWR1_WORKDIR": str(cwd), "CLAWR1_SESSION_ID": rollout.session_id,
                     "CLAWR1_PROMPT_ID": rollout.prompt_id}
        status, out, err = run_process(command, Path(cwd), {**os.environ, **variables}, timeout_s)
        outcome = env.outcome(final_answer(out))
    closed = close_session(root, rollout.session_id, outcome, api_key)
    if (closed is None or not closed["turns"]) and status == "ok":
        status = "no calls"
    return RolloutResult(task.id, rollout.index, rollout.session_id, rollout.prompt_id, outcome,
                         closed["turns"] if closed else 0, status, time.perf_counter() - started,
                         "" if status == "ok" else err[-STDERR_TAIL:])


def run_agent(config: Config, command: list[str], tasks: list[Task], *, group: int = 1,
              base_url: str | None = None, serve: bool = False, api_key: str | None = None,
              timeout_s: float = 600.0, concurrency: int = 1, env_factory: EnvFactory | None = None,
              judge: Judge | None = None, judge_timeout_s: float = 600.0,
              console: Console | None = None) -> list[RolloutResult]:
    """Run CMD over `tasks`, G rollouts each, against a running gateway (`base_url`, default the
    config's `gateway.host:port`) or one served here for the run (`serve`, with the reward worker;
    the run then waits for the judge before it stops).

    Returns:
        One result per rollout, in task order.
    """
    if not command:
        raise ValueError("no agent command given (run-agent ... -- CMD ARGS)")
    if not tasks:
        raise ValueError("no tasks")
    console = console or Console(stderr=True)
    make_env = env_factory or env_for(config)
    rollouts = plan(tasks, group, new_run_id("bb"), 0)

    def drive(root: str, key: str | None) -> list[RolloutResult]:
        with Progress(console=console, transient=True) as progress, ThreadPoolExecutor(max(1, concurrency)) as pool:
            bar = progress.add_task("agent rollouts", total=len(rollouts))
            futures = [pool.submit(run_one, command, root, key, r, make_env, timeout_s) for r in rollouts]
            results = []
            for future in futures:
                results.append(future.result())
                progress.advance(bar)
            return results

    if serve:
        with serve_in_process(config, judge=judge) as served:
            results = drive(served.root, served.api_key)
            with console.status("Waiting for the judge ..."):
                wait_judged(served, [r.session_id for r in rollouts], judge_timeout_s)
        return results
    host = config.gateway.host if config.gateway.host not in ("0.0.0.0", "::") else "127.0.0.1"
    root = gateway_root(base_url or f"{config.gateway.scheme}://{host}:{config.gateway.port}")
    check_gateway(root)
    return drive(root, api_key or (config.gateway.api_keys[0] if config.gateway.api_keys else None))


def check_gateway(root: str) -> None:
    """Fail before the first agent runs, not after it: is a gateway listening at `root`?"""
    try:
        httpx.get(f"{root}/healthz", timeout=10).raise_for_status()
    except httpx.HTTPError as exc:
        raise ConnectionError(f"no Claw-R1 gateway at {root} ({exc}); start `clawr1 up` or pass --serve") from exc
