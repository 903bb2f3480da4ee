"""`clawr1 demo`: simulated users talk to the real main job while it learns their preferences.

The demo starts `clawr1 up` (gateway, judge, trainer: the production process with the product's
defaults, untouched unless flags say otherwise) on a free loopback port in its own data directory,
measures the base model on held-out prompts, lets the users talk through the gateway like
OpenClaw does (no session headers: history matching finds the sessions), shows the preference
score and the sane rate per policy version live, and measures again once the trainer has
published `steps` versions. Nothing reads a user's hidden preference except the score: rewards and
hints come from the production judge reading the users' replies.

The headline is the held-out share of replies that keep the preference *and* are sane (within the
base model's own range, `clawr1.quality`), printed beside the preference score and the sane rate:
a policy that wins its score with nonsense must show it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator
from rich.console import Console, Group
from rich.live import Live

from clawr1.core.config import Config, to_toml
from clawr1.core.records import POLICY
from clawr1.datapool import DataPool, open_existing_pool
from clawr1.demo.evaluate import EvalResult, evaluate
from clawr1.demo.live import QualityTracker, Scoreboard, live_table, talk, version_of
from clawr1.demo.preferences import DEFAULT_PREFERENCES, parse_preferences
from clawr1.demo.report import summary
from clawr1.demo.users import HELD_OUT, make_users

__all__ = ["DemoSettings", "MainJob", "Scoreboard", "run_demo", "summary", "version_of"]


class DemoSettings(BaseModel):
    """What a demo run does (the CLI's flags)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    method: str = Field("combine", pattern="^(rl|opd|combine)$")
    """Training objective of the main job (the production default is combine)."""
    preferences: tuple[str, ...] = DEFAULT_PREFERENCES
    """The users' preferences, assigned round-robin (`clawr1.demo.preferences`)."""
    steps: int = Field(16, ge=1, le=1000)
    """Stop once the gateway serves this policy version (= optimizer steps)."""
    users: int = Field(9, ge=1, le=64)
    """Simulated users talking at once."""
    turns: int = Field(3, ge=2, le=20)
    """User messages per conversation before a new one starts."""
    batch_size: int | None = Field(None, ge=1, le=1024)
    """Samples per optimizer step; None: the product default (`trainer.batch_size`)."""
    lr: float | None = Field(None, gt=0, le=1.0)
    """LoRA learning rate; None: the product default (`trainer.lr`)."""
    max_tokens: int = Field(64, ge=8, le=4096)
    """Reply length cap the users' client sets (a truncated reply keeps no preference)."""
    temperature: float | None = Field(None, ge=0, le=2)
    """Sampling temperature the users' client sets; None: it sends none, as stock clients (the OpenAI
    SDKs, OpenClaw) do, and the model's recommended sampling applies (Qwen2.5: 0.7, top_p 0.8, top_k 20)."""
    seed: int = Field(0, ge=0)
    """Seeds the users (questions, phrasings) and the evaluation's sampling."""
    max_minutes: float = Field(14.0, gt=0, le=24 * 60)
    """Stop talking after this long even if `steps` versions were not reached."""
    eval_questions: int = Field(8, ge=0, le=len(HELD_OUT))
    """Held-out questions per preference in the before/after evaluation (0 = skip it, and with it
    every quality number: the base's held-out replies are the reference)."""
    eval_every: int | None = Field(None, ge=1, le=1000)
    """Also evaluate on the held-out prompts every this many versions (a held-out curve)."""
    quality_batch: int = Field(16, ge=1, le=512)
    """Users' replies measured per `/v1/quality` call for the live sane rate."""
    memory: bool = False
    """The users name themselves (`X-User-Id`: their names), so each one's corrections become memory
    entries added to that user's later prompts (`memory`); the held-out evaluation asks as the users
    of the same names (each has a talking namesake of the same preference), so its replies carry
    what those users said. Off (the default): plain requests that name nobody, and the numbers are
    the weights' alone."""
    users_want_substance: bool = False
    """The talking users also complain about an answer that says nothing the question did not
    (`questions.substantive`), as a person would. The held-out evaluation's users never do, so its
    numbers compare with runs without it; its strict headline counts substance either way."""

    @field_validator("preferences", mode="before")
    @classmethod
    def _known(cls, value: Any) -> tuple[str, ...]:
        return parse_preferences(value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MainJob:
    """`clawr1 up` as a child process, exactly as a user starts it: the caller's config (trainer
    settings included) and only the overrides the demo's own flags set."""

    def __init__(self, config: Config, settings: DemoSettings, run_dir: Path, model_path: Path):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = run_dir / "up.log"
        config_path = run_dir / "config.toml"  # the caller's config (judge, trainer, ...); secrets redacted
        config_path.write_text(to_toml(config))
        self.command = [sys.executable, "-m", "clawr1.cli.main", "up", "--config", str(config_path),
                        "--data-dir", str(run_dir), "--port", str(self.port), "--method", settings.method,
                        "--model", str(model_path), "--set", f"trainer.seed={settings.seed}",
                        # Room for every user and the guard's probes at once: probes queued behind
                        # nine users' replies would add minutes to each version's verdict.
                        "--set", f"engine.max_batch={max(8, settings.users) + config.guard.probes}",
                        "--set", f"engine.threads={config.engine.threads}"]
        if settings.batch_size is not None:
            self.command += ["--batch-size", str(settings.batch_size)]
        if settings.lr is not None:
            self.command += ["--set", f"trainer.lr={settings.lr}"]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 180.0) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it until it exits
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"clawr1 up exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.5)
        raise TimeoutError(f"clawr1 up did not answer within {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)  # `up` stops its trainer and closes the pool on Ctrl-C
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _raise_failed(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]


async def run_demo(config: Config, settings: DemoSettings, console: Console) -> dict[str, Any]:
    """Run one demo; returns (and writes to `<run dir>/demo.json`) the numbers."""
    from openai import AsyncOpenAI

    from clawr1.engine.models import resolve_model

    run_dir = Path(config.data_dir) / "demo" / f"{settings.method}-seed{settings.seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    with console.status("Preparing the model ..."):
        model_path = resolve_model(config.engine.model, Path(config.data_dir))
    job = MainJob(config, settings, run_dir, model_path)
    started = time.monotonic()
    client: AsyncOpenAI | None = None
    pool: DataPool | None = None
    curve: list[dict[str, Any]] = []
    metrics: list[dict[str, Any]] = []
    try:
        with console.status(f"Starting `clawr1 up` on {job.base_url} (log {job.log_path}) ..."):
            await asyncio.to_thread(job.start)
        # The main job's pool, read as the dashboard reads it: each version's trainer metrics are
        # rows of its version log (`trained_versions`), wherever the trainer ran.
        pool = open_existing_pool(config.model_copy(update={"data_dir": run_dir}))
        client = AsyncOpenAI(base_url=f"{job.base_url}/v1", api_key="demo", max_retries=0, timeout=600)
        eval_users = make_users(len(settings.preferences), settings.seed + 7919, settings.preferences)

        async def ask(label: str, reference: EvalResult | None, **how: bool) -> EvalResult:
            result = await evaluate(client, eval_users, max_tokens=settings.max_tokens,
                                    temperature=settings.temperature,
                                    seed=settings.seed, questions=HELD_OUT[: settings.eval_questions],
                                    reference=reference, **how)
            shown = result.as_dict()
            pas = "-" if shown["preferred_and_sane"] is None else f"{shown['preferred_and_sane']:.2f}"
            sane = "-" if shown["sane_rate"] is None else f"{shown['sane_rate']:.2f}"
            console.print(f"{label}: preferred and sane {pas}, preference score {shown['score']:.2f}, sane rate {sane} "
                          f"on {shown['n']} held-out replies (served by {', '.join(shown['versions'])})"
                          + (f"; {result.quality_error}" if result.quality_error else ""))
            return result

        async def measure(label: str, reference: EvalResult | None
                          ) -> tuple[EvalResult, dict[str, Any], dict[str, EvalResult]]:
            """The held-out numbers as served (with the users' memory under `--memory`), as a curve
            point, and, under `--memory`, the two halves apart (also in the point): the same version
            without the memory (what the weights learned) and the base with the memory (what the
            memory alone does)."""
            result = await ask(label, reference, named=settings.memory)
            point, apart = _point(result), {}
            if settings.memory and reference is not None:
                for key, how, named in (("weights_alone", "without memory", False),
                                        ("memory_alone", "the base with memory", True)):
                    apart[key] = await ask(f"{label}, {how}", reference, named=named, on_base=named)
                    point[key] = _point(apart[key])
            return result, point, apart

        before, after_apart = None, {}
        if settings.eval_questions:
            with console.status("Evaluating the base model on held-out prompts (before) ..."):
                before, before_point, _ = await measure("before", None)
        references = [r.completion_id for r in before.base] if before and before.calibration else []
        board, done = Scoreboard(), asyncio.Event()
        users = make_users(settings.users, settings.seed, settings.preferences, turns=settings.turns,
                           wants_substance=settings.users_want_substance)
        tasks = [asyncio.create_task(talk(u, client, board, settings.turns, settings.max_tokens, settings.temperature,
                                          done, named=settings.memory)) for u in users]
        if references:  # else nothing to measure the users' replies against: the sane column stays empty
            tracker = QualityTracker(client, board, references, settings.quality_batch)
            tasks.append(asyncio.create_task(tracker.run(done)))
        deadline = started + settings.max_minutes * 60
        talk_started, shown, evaluating = time.monotonic(), 0, None
        next_eval = settings.eval_every if before is not None and settings.eval_every else None
        with Live(console=console, refresh_per_second=2, transient=False) as live:
            while board.latest() < settings.steps and time.monotonic() < deadline:
                _raise_failed(tasks)
                if next_eval is not None and board.latest() >= next_eval and evaluating is None:
                    evaluating = asyncio.create_task(measure(f"v{board.latest()}", before))
                    next_eval = (board.latest() // settings.eval_every + 1) * settings.eval_every  # users keep talking
                if evaluating is not None and evaluating.done():
                    curve.append(evaluating.result()[1])
                    evaluating = None
                live.update(Group(live_table(board, await trained(pool), settings.method, started, curve)))
                if not console.is_terminal and board.latest() > shown:  # a log file gets one line per version
                    shown, rows = board.latest(), board.per_version()
                    row = rows[-2] if len(rows) > 1 else rows[-1]
                    sane = ("" if row["sane_rate"] is None
                            else f", sane {row['sane_rate']:.2f} of {row['measured']} measured")
                    console.print(f"[{time.monotonic() - started:.0f} s] serving v{shown}; v{row['version']} scored "
                                  f"{row['score']:.2f} over {row['replies']} replies{sane}")
                await asyncio.sleep(1.0)
            done.set()
            await asyncio.gather(*tasks)
            if references:  # every user has stopped: measure what the tracker has not
                await tracker.flush()
            if evaluating is not None:
                curve.append((await evaluating)[1])
            live.update(Group(live_table(board, await trained(pool), settings.method, started, curve)))
        talk_s = time.monotonic() - talk_started
        after = None
        if before is not None:
            with console.status("Evaluating the served version on held-out prompts (after) ..."):
                after, after_point, after_apart = await measure("after", before)
    finally:
        if client is not None:
            await client.close()  # before the loop ends, or its connections are closed on a dead loop
        await asyncio.to_thread(job.stop)
        if pool is not None:
            try:
                metrics = await trained(pool)  # every version the trainer published, read once it stopped
            finally:
                pool.close()
    result = {
        "method": settings.method, "settings": settings.model_dump(), "wall_s": time.monotonic() - started,
        "talk_s": talk_s, "replies": board.replies, "reached_version": board.latest(),
        "per_version": board.per_version(),
        "before": before.as_dict() if before else None, "after": after.as_dict() if after else None,
        "curve": ([before_point] if before else []) + curve + ([after_point] if after else []),
        # Under --memory: the last version's replies without it, and the base's with it.
        "after_apart": {key: apart.as_dict() for key, apart in after_apart.items()} or None,
        "trainer": [{k: m.get(k) for k in ("version", "lease", "loss", "reward_mean", "hint_rate", "total_s")}
                    for m in metrics],
    }
    (run_dir / "demo.json").write_text(json.dumps(result, indent=1))
    summary(result, console)
    return result


async def trained(pool: DataPool) -> list[dict[str, Any]]:
    """The trainer's metrics per published version of the shared policy, oldest first (off the
    event loop: a pool read)."""
    return await asyncio.to_thread(pool.trained_versions, POLICY)


def _point(result: EvalResult) -> dict[str, Any]:
    """A held-out evaluation as a point of the curve: its numbers at the version that served most of it."""
    shown = {k: v for k, v in result.as_dict().items() if k not in ("replies", "base_replies", "base", "calibration")}
    return {"version": version_of(max(shown["versions"], key=shown["versions"].get)), **shown}
