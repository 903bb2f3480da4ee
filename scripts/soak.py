"""Soak: `clawr1 up` under simulated users for a long while, watching for what only time shows.

    .venv/bin/python scripts/soak.py                 # the release soak: 30 minutes
    .venv/bin/python scripts/soak.py --minutes 3     # a quick look

It starts `clawr1 up` as a user does (as the demo's `MainJob`: a child process, a fresh data dir
under /tmp, the embedded model, the judge and trainer running) and drives the demo's simulated
users against it, plain OpenAI requests, conversation after conversation. Every `--sample-s` it
samples the resident memory (VmRSS) and open file descriptors of the `up` process and of its
trainer child, the gateway's `clawr1_gateway_inflight`, and the requests sent and failed.

A leak that a test of seconds never sees (a dict keyed by session, a connection per request, a
version's adapter never released, a file left open per publish) shows as a slope here, so the
verdict compares the end with the state after warm-up (the first 20% of the run: the model, the
allocator's arenas and the caches are filled by then):
- RSS and FDs of both processes flat: the median of the last fifth of the run within 10% of the
  median of the fifth after warm-up (`growth`);
- `clawr1_gateway_inflight` back to 0 once the users stop;
- no failed request (the users never retry; any non-200 or transport error counts);
- how many policy versions were served (the trainer kept publishing and the gateway swapping).
It prints a table and a JSON summary (also `<run dir>/soak.json`) and exits 0 if all hold, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from clawr1.demo.users import SimulatedUser, make_users
from clawr1.engine.models import EMBEDDED_MODEL, resolve_model

WARM_UP = 0.2  # the share of the run after which memory and descriptors should be flat
FLAT = 0.10  # how much they may grow from then to the end


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the process under test ---------------------------------------------------------------------
def rss_kib(pid: int) -> int | None:
    """Resident memory in KiB (None once the process is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) if match else None


def fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return None


def trainer_of(pid: int) -> int | None:
    """The `clawr1 ... train` child of the `up` process (it restarts one that dies: a new pid)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended while we looked
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # the name in parentheses may hold spaces
        if ppid == pid and b"train" in cmdline:
            return int(entry)
    return None


def metric(text: str, name: str) -> float | int | None:
    """The sum of a metric's samples in Prometheus text (None if absent); an int when whole."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith((name + " ", name + "{"))]
    if not values:
        return None
    total = sum(values)
    return int(total) if total.is_integer() else total


class Up:
    """`clawr1 up` in a fresh data dir, as the demo's `MainJob` starts it."""

    def __init__(self, run_dir: Path, model: Path, overrides: list[str]):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = run_dir / "up.log"
        self.command = [sys.executable, "-m", "clawr1.cli.main", "up", "--data-dir", str(run_dir),
                        "--port", str(self.port), "--model", str(model)]
        for override in overrides:
            self.command += ["--set", override]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 300.0) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it until it exits
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
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

    def stop(self) -> int | None:
        """Ctrl-C, as a user stops it (it stops its trainer and closes the pool); its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# ---- the users ----------------------------------------------------------------------------------
@dataclass
class Traffic:
    sent: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)  # the first few, for the report
    versions: dict[int, int] = field(default_factory=dict)  # replies per serving policy version

    def fail(self, what: str) -> None:
        self.failed += 1
        if len(self.errors) < 10:
            self.errors.append(what)


async def talk(user: SimulatedUser, client: httpx.AsyncClient, traffic: Traffic, turns: int, max_tokens: int,
               done: asyncio.Event) -> None:
    """One user's conversations, back to back, until `done`: no retries, every failure counted."""
    while not done.is_set():
        messages = [{"role": "system", "content": user.system}, {"role": "user", "content": user.first_message()}]
        for _ in range(turns):
            traffic.sent += 1
            try:
                response = await client.post("/v1/chat/completions", json={
                    "model": "clawr1", "messages": messages, "max_tokens": max_tokens, "temperature": 0.7})
            except httpx.HTTPError as exc:
                traffic.fail(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(1.0)
                break
            if response.status_code != 200:
                traffic.fail(f"{response.status_code}: {response.text[:200]}")
                await asyncio.sleep(1.0)
                break
            body = response.json()
            choice = body["choices"][0]
            version = int(str(body.get("system_fingerprint", "clawr1-v0")).rsplit("v", 1)[1])
            traffic.versions[version] = traffic.versions.get(version, 0) + 1
            text = choice["message"].get("content") or ""
            _, said = user.react(text, choice["finish_reason"] == "stop")
            if done.is_set():
                return
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": said}]


# ---- sampling -----------------------------------------------------------------------------------
async def sample(up: Up, client: httpx.AsyncClient, traffic: Traffic, started: float) -> dict[str, Any]:
    assert up.proc is not None
    trainer = await asyncio.to_thread(trainer_of, up.proc.pid)
    scraped = (await client.get("/metrics")).text
    return {"t_s": round(time.monotonic() - started, 1),
            "up_rss_mib": _mib(rss_kib(up.proc.pid)), "up_fds": fd_count(up.proc.pid),
            "trainer_pid": trainer,
            "trainer_rss_mib": _mib(rss_kib(trainer)) if trainer else None,
            "trainer_fds": fd_count(trainer) if trainer else None,
            "inflight": metric(scraped, "clawr1_gateway_inflight"),
            "pending_writes": metric(scraped, "clawr1_pool_pending_writes"),
            "version": metric(scraped, "clawr1_policy_version"),
            "sent": traffic.sent, "failed": traffic.failed}


def _mib(kib: int | None) -> float | None:
    return None if kib is None else round(kib / 1024, 1)


def growth(samples: list[dict[str, Any]], key: str, duration: float) -> dict[str, Any]:
    """After warm-up against the end: the median of the samples in the fifth of the run just after
    warm-up ([20%, 40%)) against the median of its last fifth (from 80%, the drain included).
    Medians of windows, not two single samples: RSS swings by ~10% between two samples while a
    request's tensors come and go, and a leak is a slope, not a swing."""
    values = [(s["t_s"], s[key]) for s in samples if s[key] is not None]
    if not values:
        return {"warm": None, "end": None, "max": None, "growth": None, "flat": None}
    warm = statistics.median([v for t, v in values if WARM_UP * duration <= t < 2 * WARM_UP * duration]
                             or [values[0][1]])
    end = statistics.median([v for t, v in values if t >= (1 - WARM_UP) * duration] or [values[-1][1]])
    change = (end - warm) / warm if warm else 0.0
    return {"warm": warm, "end": end, "max": max(v for _, v in values), "growth": round(change, 3),
            "flat": change <= FLAT}


def table(samples: list[dict[str, Any]], rows: int = 40) -> str:
    """The samples as a text table (at most `rows` of them, evenly spread, the last always shown)."""
    keys = ["t_s", "up_rss_mib", "up_fds", "trainer_rss_mib", "trainer_fds", "inflight", "pending_writes",
            "version", "sent", "failed"]
    step = max(1, len(samples) // rows)
    shown = samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else [])
    lines = ["  ".join(f"{k:>15}" for k in keys)]
    for s in shown:
        lines.append("  ".join(f"{'-' if s[k] is None else s[k]:>15}" for k in keys))
    return "\n".join(lines)


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    model = Path(args.model) if args.model else resolve_model(EMBEDDED_MODEL, Path(args.model_cache))
    run_dir = Path(tempfile.mkdtemp(prefix="clawr1-soak-", dir=args.tmp))
    up = Up(run_dir, model, args.set)
    print(f"starting clawr1 up on {up.base_url} in {run_dir} (log {up.log_path})", flush=True)
    await asyncio.to_thread(up.start)
    traffic, samples, done = Traffic(), [], asyncio.Event()
    duration = args.minutes * 60
    limits = httpx.Limits(max_connections=args.users + 4)
    exit_code = None
    try:
        async with httpx.AsyncClient(base_url=up.base_url, timeout=args.request_timeout, limits=limits) as client:
            started = time.monotonic()
            users = make_users(args.users, args.seed, turns=args.turns)
            tasks = [asyncio.create_task(talk(u, client, traffic, args.turns, args.max_tokens, done)) for u in users]
            while time.monotonic() - started < duration:
                samples.append(await sample(up, client, traffic, started))
                s = samples[-1]
                print(f"[{s['t_s']:>7.1f} s] up {s['up_rss_mib']} MiB {s['up_fds']} fds | trainer "
                      f"{s['trainer_rss_mib']} MiB {s['trainer_fds']} fds | inflight {s['inflight']} | "
                      f"v{s['version']} | sent {s['sent']} failed {s['failed']}", flush=True)
                for task in tasks:
                    if task.done() and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]  # a bug in the soak itself
                await asyncio.sleep(min(args.sample_s, max(0.0, duration - (time.monotonic() - started))))
            done.set()
            await asyncio.gather(*tasks)  # each user finishes the request it is waiting on
            drained_at = time.monotonic()
            while True:  # what was admitted is handed to the pool within moments
                samples.append(await sample(up, client, traffic, started))
                if samples[-1]["inflight"] == 0 or time.monotonic() - drained_at > 30:
                    break
                await asyncio.sleep(0.5)
            swaps = metric((await client.get("/metrics")).text, "clawr1_policy_swaps_total")
    finally:
        exit_code = await asyncio.to_thread(up.stop)
    trainers = sorted({s["trainer_pid"] for s in samples if s["trainer_pid"]})
    summary = {
        "minutes": args.minutes, "users": args.users, "run_dir": str(run_dir), "samples": len(samples),
        "warm_up_s": WARM_UP * duration,
        **{key: growth(samples, key, duration) for key in ("up_rss_mib", "up_fds", "trainer_rss_mib", "trainer_fds")},
        "trainer_pids": trainers,
        "inflight_end": samples[-1]["inflight"],
        "sent": traffic.sent, "failed": traffic.failed, "errors": traffic.errors,
        "versions_served": sorted(traffic.versions), "replies_per_version": traffic.versions,
        "policy_swaps": swaps, "up_exit_code": exit_code,
    }
    summary["pass"] = bool(
        all(summary[k]["flat"] is not False for k in ("up_rss_mib", "up_fds", "trainer_rss_mib", "trainer_fds"))
        and summary["inflight_end"] == 0 and traffic.failed == 0 and len(trainers) <= 1)
    (run_dir / "soak.json").write_text(json.dumps({"summary": summary, "samples": samples}, indent=1))
    print()
    print(table(samples))
    print()
    for key in ("up_rss_mib", "up_fds", "trainer_rss_mib", "trainer_fds"):
        g = summary[key]
        change = "-" if g["growth"] is None else f"{g['growth']:+.1%}"
        print(f"{key:>16}: after warm-up {g['warm']}, end {g['end']} (max {g['max']}), growth {change} -> "
              f"{'flat' if g['flat'] else 'GROWING'}")
    print(f"inflight at the end {summary['inflight_end']}; {traffic.sent} requests, {traffic.failed} failed; "
          f"versions served {summary['versions_served']} ({swaps} swaps); trainer pids {trainers}")
    print(json.dumps(summary))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the users talk (default 30)")
    parser.add_argument("--users", type=int, default=4, help="simulated users talking at once (default 4)")
    parser.add_argument("--turns", type=int, default=3, help="user messages per conversation (default 3)")
    parser.add_argument("--max-tokens", type=int, default=48, help="reply length cap the users set (default 48)")
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples (default 10)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="a request's client timeout (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="a Hugging Face model directory (default: the embedded model)")
    parser.add_argument("--model-cache", default=str(Path(tempfile.gettempdir()) / "clawr1-soak-models"),
                        help="where the embedded model is converted once and reused between soaks")
    parser.add_argument("--tmp", default=tempfile.gettempdir(), help="where the fresh data dir is made")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for `clawr1 up` (repeatable), e.g. trainer.batch_size=8")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.users < 1 or args.sample_s <= 0:
        parser.error("--minutes and --sample-s must be > 0 and --users >= 1")
    return 0 if asyncio.run(soak(args))["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
