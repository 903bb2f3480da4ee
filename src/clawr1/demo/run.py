"""`clawr1 demo`: simulated users talk to the real main job while it learns their preferences.

The demo starts `clawr1 up` (gateway, judge, trainer: the production process, untouched) on a free
loopback port in its own data directory, measures the served version on held-out prompts, lets
the users talk through the gateway like OpenClaw does (no session headers: history matching
finds the sessions), shows the preference score per policy version live, and measures again once
the trainer has published `steps` versions. Nothing reads a user's hidden preference except the
score: rewards and hints come from the production judge reading the users' replies.
"""

from __future__ import annotations

import asyncio
import collections
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
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from clawr1.core.config import Config, to_toml
from clawr1.demo.evaluate import EvalResult, evaluate
from clawr1.demo.users import HELD_OUT, PREFERENCES, SimulatedUser, make_users
from clawr1.trainer.history import read_metrics


class DemoSettings(BaseModel):
    """What a demo run does (the CLI's flags)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    method: str = Field("combine", pattern="^(rl|opd|combine)$")
    """Training objective of the main job (the production default is combine)."""
    steps: int = Field(16, ge=1, le=1000)
    """Stop once the gateway serves this policy version (= optimizer steps)."""
    users: int = Field(9, ge=1, le=64)
    """Simulated users talking at once; preferences are assigned round-robin."""
    turns: int = Field(3, ge=2, le=20)
    """User messages per conversation before a new one starts."""
    batch_size: int = Field(8, ge=1, le=1024)
    """Samples per optimizer step."""
    lr: float = Field(1e-3, gt=0, le=1.0)
    """LoRA learning rate for the demo's trainer."""
    max_tokens: int = Field(64, ge=8, le=4096)
    """Reply length cap the users' client sets (a truncated reply breaks 'one short paragraph')."""
    temperature: float = Field(0.7, ge=0, le=2)
    """Sampling temperature the users' client sets."""
    seed: int = Field(0, ge=0)
    """Seeds the users (questions, phrasings) and the evaluation's sampling."""
    max_minutes: float = Field(14.0, gt=0, le=24 * 60)
    """Stop talking after this long even if `steps` versions were not reached."""
    eval_questions: int = Field(8, ge=0, le=8)
    """Held-out questions per preference in the before/after evaluation (0 = skip it)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def version_of(fingerprint: str | None) -> int:
    return int(fingerprint.rsplit("-v", 1)[1]) if fingerprint and "-v" in fingerprint else -1


class MainJob:
    """`clawr1 up` as a child process, exactly as a user starts it."""

    def __init__(self, config: Config, settings: DemoSettings, run_dir: Path, model_path: Path):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = run_dir / "up.log"
        config_path = run_dir / "config.toml"  # the caller's config (judge, trainer, ...); secrets redacted
        config_path.write_text(to_toml(config))
        self.command = [sys.executable, "-m", "clawr1.cli.main", "up", "--config", str(config_path),
                        "--data-dir", str(run_dir),
                        "--port", str(self.port), "--method", settings.method,
                        "--batch-size", str(settings.batch_size), "--model", str(model_path),
                        "--set", f"trainer.lr={settings.lr}", "--set", f"trainer.seed={settings.seed}",
                        "--set", f"engine.max_batch={max(8, settings.users)}",
                        # Full batches only: the demo produces plenty, and then a version is a step.
                        "--set", "trainer.max_wait_s=3600",
                        "--set", f"engine.threads={config.engine.threads}"]
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


class Scoreboard:
    """Preference score per served version, from the users' own replies."""

    def __init__(self) -> None:
        self.kept: dict[int, list[bool]] = collections.defaultdict(list)
        self.replies = 0

    def add(self, version: int, kept: bool) -> None:
        self.kept[version].append(kept)
        self.replies += 1

    def per_version(self) -> list[dict[str, Any]]:
        return [{"version": v, "replies": len(k), "score": sum(k) / len(k)} for v, k in sorted(self.kept.items())]

    def latest(self) -> int:
        return max(self.kept, default=0)


async def talk(user: SimulatedUser, client: Any, board: Scoreboard, settings: DemoSettings, done: asyncio.Event) -> None:
    """One user's conversations, back to back, until `done`. Plain OpenAI requests, no headers."""
    while not done.is_set():
        messages = [{"role": "system", "content": user.system}, {"role": "user", "content": user.first_message()}]
        for _ in range(settings.turns):
            response = await client.chat.completions.create(model="clawr1", messages=messages,
                                                            max_tokens=settings.max_tokens,
                                                            temperature=settings.temperature)
            choice = response.choices[0]
            text = choice.message.content or ""
            kept, said = user.react(text, choice.finish_reason == "stop")
            board.add(version_of(response.system_fingerprint), kept)
            if done.is_set():
                return
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": said}]


def live_table(board: Scoreboard, metrics: list[dict[str, Any]], settings: DemoSettings, started: float) -> Table:
    by_version = {m["version"]: m for m in metrics}
    table = Table(title=f"clawr1 demo ({settings.method}): preference score per policy version "
                        f"[{time.monotonic() - started:.0f} s, {board.replies} replies]")
    for col in ("version", "replies", "score", "", "trained on", "reward", "hints", "loss"):
        table.add_column(col, justify="right" if col else "left")
    for row in board.per_version()[-18:]:
        m = by_version.get(row["version"], {})
        bar = "#" * round(row["score"] * 20)
        table.add_row(f"v{row['version']}", str(row["replies"]), f"{row['score']:.2f}", bar,
                      str(m.get("lease", "")), f"{m['reward_mean']:+.2f}" if m else "",
                      f"{m['hint_rate']:.0%}" if m else "", f"{m['loss']:+.3f}" if m else "")
    return table


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
    try:
        with console.status(f"Starting `clawr1 up` on {job.base_url} (log {job.log_path}) ..."):
            await asyncio.to_thread(job.start)
        client = AsyncOpenAI(base_url=f"{job.base_url}/v1", api_key="demo", max_retries=0, timeout=600)
        eval_users = make_users(len(PREFERENCES), settings.seed + 7919)

        async def measure(label: str) -> EvalResult | None:
            if not settings.eval_questions:
                return None
            with console.status(f"Evaluating the served version on held-out prompts ({label}) ..."):
                result = await evaluate(client, eval_users, max_tokens=settings.max_tokens,
                                        temperature=settings.temperature, seed=settings.seed,
                                        questions=HELD_OUT[: settings.eval_questions])
            console.print(f"{label}: preference score {result.score:.2f} on {result.n} held-out replies "
                          f"({', '.join(f'{k} {v:.2f}' for k, v in result.by_preference.items())}; "
                          f"served by {', '.join(result.versions)})")
            return result

        before = await measure("before")
        board, done = Scoreboard(), asyncio.Event()
        users = make_users(settings.users, settings.seed, turns=settings.turns)
        talkers = [asyncio.create_task(talk(u, client, board, settings, done)) for u in users]
        deadline = started + settings.max_minutes * 60
        talk_started, shown = time.monotonic(), 0
        with Live(console=console, refresh_per_second=2, transient=False) as live:
            while board.latest() < settings.steps and time.monotonic() < deadline:
                for task in talkers:
                    if task.done() and task.exception() is not None:
                        raise task.exception()
                live.update(Group(live_table(board, read_metrics(run_dir), settings, started)))
                if not console.is_terminal and board.latest() > shown:  # a log file gets one line per version
                    shown, rows = board.latest(), board.per_version()
                    row = rows[-2] if len(rows) > 1 else rows[-1]
                    console.print(f"[{time.monotonic() - started:.0f} s] serving v{shown}; "
                                  f"v{row['version']} scored {row['score']:.2f} over {row['replies']} replies")
                await asyncio.sleep(1.0)
            done.set()
            await asyncio.gather(*talkers)
            live.update(Group(live_table(board, read_metrics(run_dir), settings, started)))
        talk_s = time.monotonic() - talk_started
        after = await measure("after")
    finally:
        if client is not None:
            await client.close()  # before the loop ends, or its connections are closed on a dead loop
        await asyncio.to_thread(job.stop)
    metrics = read_metrics(run_dir)
    result = {
        "method": settings.method, "settings": settings.model_dump(), "wall_s": time.monotonic() - started,
        "talk_s": talk_s, "replies": board.replies, "reached_version": board.latest(),
        "per_version": board.per_version(),
        "before": before.as_dict() if before else None, "after": after.as_dict() if after else None,
        "trainer": [{k: m.get(k) for k in ("version", "lease", "loss", "reward_mean", "hint_rate", "total_s")}
                    for m in metrics],
    }
    (run_dir / "demo.json").write_text(json.dumps(result, indent=1))
    summary(result, console)
    return result


def summary(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"demo summary ({result['method']})")
    table.add_column("")
    table.add_column("value", justify="right")
    if result["before"] and result["after"]:
        table.add_row("held-out preference score before", f"{result['before']['score']:.2f}")
        table.add_row("held-out preference score after", f"{result['after']['score']:.2f}")
        table.add_row("mean words per reply before / after",
                      f"{result['before']['mean_words']:.0f} / {result['after']['mean_words']:.0f}")
    rows = result["per_version"]
    if rows:
        table.add_row("live score, first / last version", f"{rows[0]['score']:.2f} / {rows[-1]['score']:.2f}")
    table.add_row("optimizer steps (versions served)", str(result["reached_version"]))
    table.add_row("user replies", str(result["replies"]))
    table.add_row("wall time", f"{result['wall_s']:.0f} s")
    console.print(table)
