"""Feedback-to-serving latency (`clawr1 bench latency`): once a user corrects the agent, how long until
the gateway answers with a policy trained on that correction?

`clawr1 up` runs as a user would run it (gateway + reward worker in one process, the trainer in its
own) on a fresh data dir, with a small batch and `trainer.max_wait_s = 0`, so the trainer takes a
partial batch as soon as one sample is READY. Per repeat, in a session of its own, a scripted client:
1. asks a question (turn 0);
2. at t0 posts feedback on it (reward -1 and a correction, which becomes a hint) and sends the
   corrective user turn (turn 1). Feedback goes first: turn 0 then has a reward before its next state
   exists, so the reward worker never judges it (a judge score stored later would replace the
   feedback's reward, and a 0 would send the sample back to PENDING).
Meanwhile a poller sends 1-token requests back to back and notes each reply's `system_fingerprint`
(and watches `/healthz` for the moment the gateway has a version loaded).
The latency is t0 to the first poll reply from the version whose training step consumed turn 0 (read
from the pool: the sample's lease, acked just before the trainer logs that version in
`<data_dir>/trainer/metrics.jsonl`).

Where the time went: t0 -> sample READY (feedback stored), READY -> leased (trainer's poll), leased ->
published (load, prepare, train, publish: the trainer's metrics), published -> loaded in the gateway
(its adapter poll and the engine's load, as `/healthz` shows), loaded -> first reply from it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
from rich.console import Console
from rich.table import Table

from benchmarks.http_load import Server, start
from benchmarks.swap import version_of
from clawr1.core.config import Config, load_config, to_toml
from clawr1.engine import adapters
from clawr1.engine.models import resolve_model

GOAL_MEDIAN_S = 60.0
QUESTION = "What is the capital of France?"
CORRECTION = "No, that is wrong. Answer with just the city name, in one word."
T = TypeVar("T")


class Poller:
    """1-token requests back to back; remembers (wall time of each reply, its version), and when
    `/healthz` first listed each policy version as loaded."""

    def __init__(self, http: httpx.AsyncClient, pause_s: float):
        self.http, self.pause_s = http, pause_s
        self.seen: list[tuple[float, int]] = []
        self.errors: list[str] = []
        self.task: asyncio.Task | None = None
        self.loaded: dict[int, float] = {}

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.gather(self._complete(stop), self._health(stop))

    async def _health(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            response = await self.http.get("/healthz")
            response.raise_for_status()
            version = response.json()["adapters"].get("policy")
            if version is not None:
                self.loaded.setdefault(int(version), time.time())
            await asyncio.sleep(0.05)

    async def _complete(self, stop: asyncio.Event) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
        while not stop.is_set():
            try:
                response = await self.http.post("/v1/chat/completions", json=body)
            except httpx.HTTPError as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
            else:
                if response.status_code == 200:
                    self.seen.append((time.time(), version_of(response.json())))
                else:
                    self.errors.append(f"HTTP {response.status_code}: {response.text[:200]}")
            await asyncio.sleep(self.pause_s)

    def current(self) -> int:
        return self.seen[-1][1] if self.seen else 0

    def first(self, version: int, after: float) -> float | None:
        """Wall time of the first reply after `after` from `version` or newer."""
        if self.task is not None and self.task.done():
            self.task.result()  # a crashed poller (a reply without a fingerprint) fails the run now
            raise RuntimeError("the poller stopped")
        return next((when for when, v in self.seen if when > after and v >= version), None)


def run(config: Config, console: Console | None = None, repeats: int = 3, batch_size: int = 2,
        timeout_s: float = 300.0, poll_pause_s: float = 0.1, guard_both: bool = True) -> dict[str, Any]:
    """Run `repeats` corrections against `clawr1 up` on `config.engine.model` in a temporary data dir,
    print each latency, the median and where the time went, and return the numbers. `guard_both`:
    also without the guard, in the same run, so what the guard adds is measured side by side."""
    console = console or Console()
    model_path = resolve_model(config.engine.model, config.data_dir)  # converts the embedded model once
    settings = [config.guard.enabled] + ([not config.guard.enabled] if guard_both else [])
    numbers: dict[str, Any] = {}
    for guarded in settings:
        setting = config.model_copy(update={"guard": config.guard.model_copy(update={"enabled": guarded})})
        with tempfile.TemporaryDirectory(prefix="clawr1-bench-latency-") as tmp:
            reps = asyncio.run(_bench(setting, model_path, Path(tmp), console, repeats, batch_size, timeout_s,
                                      poll_pause_s))
        median = statistics.median([r["latency_s"] for r in reps])
        cell: dict[str, Any] = {
            "model": config.engine.model, "cpus": os.cpu_count(), "batch_size": batch_size, "guard": guarded,
            "method": config.trainer.method, "adapter_poll_s": config.gateway.adapter_poll_s,
            "trainer_poll_s": config.trainer.poll_s, "repeats": reps, "median_s": median,
            "goal": {"value": median, "limit": GOAL_MEDIAN_S, "ok": median <= GOAL_MEDIAN_S},
        }
        console.print(table(cell))
        numbers["guard" if guarded else "no_guard"] = cell
    if len(numbers) == 2:
        added = numbers["guard"]["median_s"] - numbers["no_guard"]["median_s"]
        numbers["guard_adds_s"] = added
        console.print(f"the guard adds {added:+.1f} s to the median feedback-to-serving latency "
                      f"({numbers['no_guard']['median_s']:.1f} -> {numbers['guard']['median_s']:.1f} s)")
    return numbers


async def _bench(config: Config, model_path: Path, workdir: Path, console: Console, repeats: int, batch_size: int,
                 timeout_s: float, poll_pause_s: float) -> list[dict[str, Any]]:
    data = workdir / "data"
    config_toml = workdir / "config.toml"
    config_toml.write_text(to_toml(config))  # the user's settings (secrets are redacted: none needed here)
    argv = [sys.executable, "-m", "clawr1.cli.main", "up", "--config", str(config_toml), "--model", str(model_path),
            "--data-dir", str(data), "--host", "127.0.0.1", "--port", "{port}", "--batch-size", str(batch_size),
            "--set", "trainer.max_wait_s=0"]
    server = start("up", argv, workdir)
    reps: list[dict[str, Any]] = []
    try:
        base = f"http://127.0.0.1:{server.port}"
        with console.status("feedback latency: starting clawr1 up ..."):
            # The trainer's directory appears once it has loaded its policy (trainer/loop.py); a
            # correction normally arrives long after startup, so startup is not counted.
            await _until(server, lambda: (data / "trainer").is_dir() or None, time.time() + timeout_s,
                         "the gateway and the trainer to start", pause=0.2, check=lambda: _healthy(base))
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            poller = Poller(http, poll_pause_s)
            stop = asyncio.Event()
            polling = poller.task = asyncio.create_task(poller.run(stop))
            try:
                for i in range(1, repeats + 1):
                    with console.status(f"feedback latency: correction {i}/{repeats} ..."):
                        reps.append(await _one(server, http, poller, data, i, timeout_s))
                    console.print(f"correction {i}: v{reps[-1]['trained_version']} served "
                                  f"{reps[-1]['latency_s']:.1f} s after it")
                    await asyncio.sleep(1.0)  # the next correction starts from a quiet system
            finally:
                stop.set()
                await polling
        if poller.errors:
            raise RuntimeError(f"{len(poller.errors)} poll requests failed; first: {poller.errors[0]}")
    finally:
        code = server.stop(timeout=60)
    if code != 0:
        raise RuntimeError(f"clawr1 up exited with {code}:\n{_logs(server)}")
    return reps


async def _one(server: Server, http: httpx.AsyncClient, poller: Poller, data: Path, index: int,
               timeout_s: float) -> dict[str, Any]:
    session = f"bench-latency-{index}-{uuid.uuid4().hex[:8]}"
    headers = {"X-Session-Id": session}
    question = [{"role": "user", "content": QUESTION}]
    first = await _chat(http, question, headers, 16)
    await _until(server, lambda: _stored(data, session), time.time() + 30, "turn 0 to be stored")
    t0 = time.time()
    version_at = max(poller.current(), version_of(first))
    feedback = await http.post("/v1/feedback", json={"session_id": session, "turn_index": 0, "reward": -1,
                                                      "correction": CORRECTION})
    feedback.raise_for_status()
    [step_id] = feedback.json()["step_ids"]
    reply = first["choices"][0]["message"]["content"]
    await _chat(http, [*question, {"role": "assistant", "content": reply}, {"role": "user", "content": CORRECTION}],
                headers, 8)
    deadline = t0 + timeout_s
    lease = await _until(server, lambda: _lease_of(data, step_id), deadline, "the trainer to train on the correction")
    trained = await _until(server, lambda: _metrics_after(data, lease["closed_at"]), deadline,
                           "the trainer's metrics of that step")
    version = int(trained["version"])
    served_at = await _until(server, lambda: poller.first(version, t0), deadline, f"v{version} to be served")
    published_at = (adapters.version_dir(data / "adapters", "policy", version) / adapters.MARKER).stat().st_mtime
    loaded_at = min((when for v, when in poller.loaded.items() if v >= version), default=None)
    parts = {key: float(trained[key]) for key in ("prepare_s", "train_s", "publish_s", "verdict_s", "total_s")
             if key in trained}
    return {"latency_s": served_at - t0, "version_at_correction": version_at, "trained_version": version,
            "lease_size": trained.get("lease"), "ready_s": lease["ready_at"] - t0,
            "pickup_s": lease["created_at"] - lease["ready_at"], "train_step_s": published_at - lease["created_at"],
            "to_serving_s": served_at - published_at,
            "swap_in_s": None if loaded_at is None else loaded_at - published_at,
            "first_reply_s": None if loaded_at is None else served_at - loaded_at, **parts}


async def _chat(http: httpx.AsyncClient, messages: list[dict[str, Any]], headers: dict[str, str],
                max_tokens: int) -> dict[str, Any]:
    response = await http.post("/v1/chat/completions", headers=headers,
                               json={"model": "m", "messages": messages, "max_tokens": max_tokens})
    response.raise_for_status()
    return response.json()


async def _healthy(base: str) -> bool:
    async with httpx.AsyncClient(timeout=2) as http:
        try:
            return (await http.get(f"{base}/healthz")).status_code == 200
        except httpx.TransportError:  # not listening yet
            return False


async def _until(server: Server, probe: Callable[[], T | None], deadline: float, what: str, pause: float = 0.05,
                 check: Callable[[], Any] | None = None) -> T:
    """Poll `probe` (and the async `check`, which must also pass) until it gives a value; fail if
    `clawr1 up` exits or the deadline passes."""
    while time.time() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"clawr1 up exited with {server.proc.returncode}:\n{_logs(server)}")
        value = probe()
        if value is not None and (check is None or await check()):
            return value
        await asyncio.sleep(pause)
    raise RuntimeError(f"timed out waiting for {what}:\n{_logs(server)}")


def _logs(server: Server) -> str:
    """The tails of the `up` log and of its trainer's log (`clawr1 up` serves on if its trainer dies)."""
    trainer = server.log.parent / "data" / "run" / "trainer.log"
    tail = trainer.read_text(errors="replace")[-2000:] if trainer.exists() else "(no trainer log)"
    return f"--- clawr1 up ---\n{server.log_tail()}\n--- trainer ---\n{tail}"


def _query(data: Path, sql: str, args: tuple[Any, ...]) -> sqlite3.Row | None:
    """One row from the pool, read-only (the gateway and the trainer are its writers)."""
    db = data / "pool.sqlite3"
    if not db.exists():
        return None
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        conn.row_factory = sqlite3.Row
        return conn.execute(sql, args).fetchone()
    finally:
        conn.close()


def _stored(data: Path, session: str) -> bool | None:
    """The reply comes before its step is committed; feedback on a turn not yet stored is a 404."""
    found = _query(data, "SELECT 1 FROM steps WHERE session_id = ? AND turn_index = 0", (session,))
    return True if found is not None else None


def _lease_of(data: Path, step_id: str) -> dict[str, Any] | None:
    """The acked lease that consumed the sample: its times and the sample's ready time."""
    row = _query(data, "SELECT s.status, s.ready_at, l.created_at, l.closed_at FROM samples s JOIN leases l "
                       "ON l.lease_id = s.lease_id WHERE s.step_id = ? AND l.state = 'acked'", (step_id,))
    if row is None:
        status = _query(data, "SELECT status, reason FROM samples WHERE step_id = ?", (step_id,))
        if status is not None and status["status"] == "dropped":
            raise RuntimeError(f"the corrected turn {step_id} was dropped ({status['reason']}), never trained")
        return None
    return dict(row)


def _metrics_after(data: Path, acked_at: float) -> dict[str, Any] | None:
    """The trainer logs a step's metrics right after acking its lease: the first line at or after the ack."""
    path = data / "trainer" / "metrics.jsonl"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        if line.strip():  # the trainer may be writing the next line
            try:
                metrics = json.loads(line)
            except json.JSONDecodeError:
                return None  # a line still being written: read again on the next poll
            if metrics["time"] >= acked_at:
                return metrics
    return None


def _fmt(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


# (label, key, indent): the parts of the latency, in the order they happen; indented rows split the one above.
ROWS = (("feedback stored (READY)", "ready_s", 0), ("trainer picks it up", "pickup_s", 0),
        ("lease -> published", "train_step_s", 0), ("prepare", "prepare_s", 1), ("train", "train_s", 1),
        ("publish", "publish_s", 1), ("published -> first reply", "to_serving_s", 0),
        ("the guard's probes and verdict", "verdict_s", 1),
        ("gateway poll + engine load", "swap_in_s", 1), ("first reply on it", "first_reply_s", 1))


def table(numbers: dict[str, Any]) -> Table:
    """One column per correction and the median (narrow enough for an 80-column terminal)."""
    reps = numbers["repeats"]
    out = Table(title=f"Feedback to serving, seconds: {numbers['model']} under `clawr1 up` (method "
                      f"{numbers['method']}, batch {numbers['batch_size']}, max_wait 0, guard "
                      f"{'on' if numbers['guard'] else 'off'}), {numbers['cpus']} CPUs")
    out.add_column("")
    for i in range(1, len(reps) + 1):
        out.add_column(f"#{i}", justify="right")
    out.add_column("median", justify="right")

    def row(label: str, values: list[float | None], style: str | None = None) -> None:
        known = [v for v in values if v is not None]
        out.add_row(label, *(_fmt(v) for v in values), _fmt(statistics.median(known) if known else None),
                    style=style)

    goal = numbers["goal"]
    met = "[green]met[/green]" if goal["ok"] else "[red]missed[/red]"
    row(f"correction -> served (goal <= {goal['limit']:.0f}: {met})", [r["latency_s"] for r in reps], "bold")
    for label, key, indent in ROWS:
        row("  " * indent + label, [r.get(key) for r in reps])
    out.add_row("versions", *(f"v{r['version_at_correction']}->v{r['trained_version']}" for r in reps), "")
    out.caption = (f"trainer poll {numbers['trainer_poll_s']} s; gateway adapter poll {numbers['adapter_poll_s']} s "
                   "(load seen on /healthz); first reply: the next 1-token request served by the new version")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Feedback-to-serving latency of `clawr1 up`.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="also print the numbers as JSON")
    args = parser.parse_args(argv)
    numbers = run(load_config(), repeats=args.repeats, batch_size=args.batch_size)
    if args.json:
        print(json.dumps(numbers))


if __name__ == "__main__":
    main()
