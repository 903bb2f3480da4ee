"""Hot-swap benchmark (`clawr1 bench swap`): new policy versions land while clients are being served.

The gateway runs with the real engine in a process of its own (as under `clawr1 serve`: uvloop, the
engine's scheduler thread, a SQLite pool recording every call) on 127.0.0.1, looking for new adapter
versions every `poll_s`. This process plays the agents and the trainer: `clients` clients send short
chat requests back to back, and a probe client sends 1-token requests (so the first reply from a
new version comes one prefill after the swap, not one whole request later); after a steady phase, a
LoRA of the trainer's shape (built once, with random non-zero B) is perturbed and published as v1,
v2, ... every `swap_every_s`.

Measured:
- failed requests over both phases (goal 0): a swap must never fail a request;
- p50/p99 latency of the requests that overlap a swap window (from the start of `publish` until
  `window_after_s` after the new version is first served) against the steady phase (goal p99 <= 1.5x);
- publish-to-serving delay per swap: from `publish` returning to the first response whose
  `system_fingerprint` carries that version (goal <= 1 s), split into detection (the gateway's poll),
  the load as the gateway sees it (waiting for the engine's current batch step, then the slot load,
  timed on the engine's thread, with whether it made a new peft slot), and the first reply from it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from benchmarks.fake import run_loop
from benchmarks.http_load import Server, percentile, start
from clawr1.core.config import Config, TrainerConfig, load_config
from clawr1.engine import adapters
from clawr1.engine.models import resolve_model

ADAPTER = "policy"  # the name the gateway serves
GOAL_P99_RATIO, GOAL_DELAY_S = 1.5, 1.0
B_STD = 0.01  # LoRA B init: visible in the logits, small enough that replies stay replies
STEP_STD = 0.002  # per-version change of B, about what a training step moves it
MESSAGES = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea."}]
PROBE = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
PROBE_PAUSE_S = 0.05  # between probes: the probe should see a swap quickly, not double the load
_FINGERPRINT = re.compile(r"^clawr1-v(\d+)$")


@dataclass
class Call:
    start: float  # perf_counter
    end: float
    version: int | None  # from `system_fingerprint`; None when the request failed
    error: str | None = None
    probe: bool = False


@dataclass
class Swap:
    version: int
    publish_start: float  # perf_counter
    publish_end: float
    first_served: float | None = None  # end of the first response from this version (or a newer one)
    loaded_at: float | None = None  # when the gateway finished loading it (its own record)
    load_s: float | None = None
    slot_s: float | None = None  # the slot load alone, on the engine's thread
    new_slot: bool | None = None


class Publisher:
    """The trainer's side: one peft model with the trainer's LoRA shape (so the engine's slot reuse
    sees what it sees in production), perturbed before each publish as a training step would."""

    def __init__(self, model_path: Path, tc: TrainerConfig, root: Path, seed: int = 0):
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        self.torch, self.root = torch, root
        self.generator = torch.Generator().manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        # As trainer/policy.py builds it; B starts random, since an all-zero B is the base model exactly.
        lora = LoraConfig(r=tc.lora_rank, lora_alpha=tc.lora_alpha, target_modules=tc.lora_targets,
                          lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
        self.model = get_peft_model(base, lora, adapter_name=ADAPTER)
        self.b = [p for name, p in self.model.named_parameters() if "lora_B" in name]
        with torch.no_grad():
            for p in self.b:
                p.copy_(torch.randn(p.shape, generator=self.generator) * B_STD)

    def publish(self, version: int) -> tuple[float, float]:
        """Perturb, then publish `version`; returns perf_counter at the start and end of `publish`."""
        with self.torch.no_grad():
            for p in self.b:
                p.add_(self.torch.randn(p.shape, generator=self.generator) * STEP_STD)
        started = time.perf_counter()
        adapters.publish(self.model, self.root, ADAPTER, version)
        return started, time.perf_counter()


# ---- the gateway process -------------------------------------------------------------------------

def serve(config_json: Path, port: int, swaps_out: Path) -> None:
    """The gateway's process: real engine, SQLite pool, uvicorn; on exit it writes the gateway's
    swap record (wall time loaded, adapter, version, load seconds) and the engine's slot loads to `swaps_out`."""
    from clawr1.datapool import SQLitePool
    from clawr1.engine import load_engine
    from clawr1.entrypoints.server import make_server, tune_gc
    from clawr1.gateway.app import create_app

    config = Config.model_validate_json(config_json.read_text())

    async def main() -> None:
        engine = load_engine(config)
        slot_loads = _time_slot_loads(engine)
        pool = SQLitePool(config.data_dir, config.pool)
        app = create_app(engine, pool, config)
        tune_gc()  # as `clawr1 serve` does
        server = make_server(app, port=port, lifespan="on")
        try:
            await server.serve()
        finally:
            # The server has stopped: nothing else waits on the loop.
            swaps_out.write_text(json.dumps({"gateway": app.state.gateway.swaps, "engine": slot_loads}))  # noqa: ASYNC240
            await engine.close()
            pool.close()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the SIGINT that stopped it after a graceful shutdown: the normal end


def _time_slot_loads(engine: Any) -> list[dict[str, Any]]:
    """Diagnosis only: time the engine's slot loads on its scheduler thread, and note whether each made
    a new peft slot, so a slow swap can be told from one that waited for a batch step. It wraps a
    private attribute of LocalEngine; without it the numbers are left out (and the log says so)."""
    loads: list[dict[str, Any]] = []
    slots = getattr(engine, "_slots", None)
    if slots is None or not callable(getattr(slots, "load", None)):
        print("swap bench: this engine has no slots to time; slot load times are left out", file=sys.stderr)
        return loads
    load, seen = slots.load, set[str]()

    def timed(path: Path, read: Any = None) -> str:
        began = time.perf_counter()
        slot = load(path, read)
        loads.append({"version": int(adapters.read_marker(path)["version"]), "slot": slot,
                      "new_slot": slot not in seen, "s": time.perf_counter() - began})
        seen.add(slot)
        return slot

    slots.load = timed
    return loads


# ---- the run -------------------------------------------------------------------------------------

def run(config: Config, console: Console | None = None, clients: int = 4, max_tokens: int = 8,
        steady_s: float = 45.0, swaps: int = 8, swap_every_s: float = 6.0, window_after_s: float = 1.0,
        poll_s: float = 0.1, start_timeout_s: float = 300.0) -> dict[str, Any]:
    """Run the benchmark on `config.engine.model`, print its tables and return the numbers.
    The gateway records into a temporary pool, never `config.data_dir`'s."""
    console = console or Console()
    model_path = resolve_model(config.engine.model, config.data_dir)  # converts the embedded model once
    with tempfile.TemporaryDirectory(prefix="clawr1-bench-swap-") as tmp:
        workdir = Path(tmp)
        served = config.model_copy(update={
            "data_dir": workdir / "data",
            "engine": config.engine.model_copy(update={"model": str(model_path)}),
            "gateway": config.gateway.model_copy(update={"adapter_poll_s": poll_s}),
            # The swap itself: every published version is served at once (the guard's probing is
            # priced by `clawr1 bench latency`, which runs `clawr1 up` as a user does).
            "guard": config.guard.model_copy(update={"enabled": False}),
        })
        with console.status("hot-swap benchmark: starting the gateway ..."):
            calls, swap_list, phases = run_loop(_bench(served, model_path, workdir, clients, max_tokens, steady_s,
                                                       swaps, swap_every_s, window_after_s, start_timeout_s))
    numbers = summarise(calls, swap_list, phases, window_after_s)
    numbers.update(model=config.engine.model, clients=clients, max_tokens=max_tokens, poll_s=poll_s,
                   cpus=os.cpu_count(), steady_s=steady_s, swap_every_s=swap_every_s, window_after_s=window_after_s,
                   engine_threads=config.engine.threads)
    for table in tables(numbers):
        console.print(table)
    return numbers


async def _bench(config: Config, model_path: Path, workdir: Path, clients: int, max_tokens: int, steady_s: float,
                 swaps: int, swap_every_s: float, window_after_s: float,
                 start_timeout_s: float) -> tuple[list[Call], list[Swap], dict[str, float]]:
    config_json, swaps_out = workdir / "config.json", workdir / "swaps.json"
    config_json.write_text(config.model_dump_json())
    server = start("gateway", [sys.executable, "-m", "benchmarks.swap", "--serve-port", "{port}", "--serve-config",
                               str(config_json), "--swaps-out", str(swaps_out)], workdir,
                   token=config.gateway.api_keys[0] if config.gateway.api_keys else None)
    calls: list[Call] = []
    swap_list: list[Swap] = []
    try:
        # Built while the gateway loads; publishing runs in a thread so the clients' loop keeps reading.
        publisher = await asyncio.to_thread(Publisher, model_path, config.trainer, Path(config.data_dir) / "adapters")
        base = f"http://127.0.0.1:{server.port}"
        await _wait_healthy(server, base, start_timeout_s)
        headers = {"Authorization": f"Bearer {server.token}"} if server.token else {}
        limits = httpx.Limits(max_connections=clients + 1, max_keepalive_connections=clients + 1)  # + the probe
        body = {"model": "m", "messages": MESSAGES, "max_tokens": max_tokens}
        async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=120) as http:
            warm: list[Call] = []  # first requests pay one-time costs (allocations, code paths): discarded
            await asyncio.gather(*(_client(http, body, warm, None, 2) for _ in range(clients)))
            if any(c.error for c in warm):
                raise RuntimeError(f"warm-up request failed: {next(c.error for c in warm if c.error)}")
            stop = asyncio.Event()
            tasks = [asyncio.create_task(_client(http, body, calls, stop)) for _ in range(clients)]
            tasks.append(asyncio.create_task(_client(http, PROBE, calls, stop, probe=True)))
            try:
                steady_start = time.perf_counter()
                await _watch(server, tasks, steady_s)
                steady_end = time.perf_counter()
                for version in range(1, swaps + 1):
                    began = time.perf_counter()
                    swap = Swap(version, *await asyncio.to_thread(publisher.publish, version))
                    swap_list.append(swap)
                    await _watch(server, tasks, began + swap_every_s - time.perf_counter())
                # The last version gets its window too: wait until it is served (or clearly is not).
                deadline = time.perf_counter() + 30
                while _first_served(calls, swap_list[-1]) is None and time.perf_counter() < deadline:
                    await _watch(server, tasks, 0.05)
                await _watch(server, tasks, window_after_s)
            finally:
                stop.set()
                await asyncio.gather(*tasks)
    finally:
        code = server.stop()
    if code != 0:
        raise RuntimeError(f"the gateway exited with {code}:\n{server.log_tail()}")
    _attach_gateway_record(swap_list, json.loads(swaps_out.read_text()))
    for swap in swap_list:
        swap.first_served = _first_served(calls, swap)
    return calls, swap_list, {"steady_start": steady_start, "steady_end": steady_end}


async def _client(http: httpx.AsyncClient, body: dict[str, Any], calls: list[Call], stop: asyncio.Event | None,
                  count: int | None = None, probe: bool = False) -> None:
    """Requests back to back until `stop` (or `count` of them); every outcome is a Call."""
    done = 0
    while (stop is None or not stop.is_set()) and (count is None or done < count):
        done += 1
        began = time.perf_counter()
        try:
            response = await http.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as exc:
            calls.append(Call(began, time.perf_counter(), None, f"{type(exc).__name__}: {exc}", probe))
            await asyncio.sleep(0.1)  # a dead server must not turn into a busy loop of failures
            continue
        end = time.perf_counter()
        if response.status_code != 200:
            calls.append(Call(began, end, None, f"HTTP {response.status_code}: {response.text[:200]}", probe))
            continue
        calls.append(Call(began, end, version_of(response.json()), None, probe))
        if probe:
            await asyncio.sleep(PROBE_PAUSE_S)


def version_of(reply: dict[str, Any]) -> int:
    match = _FINGERPRINT.match(reply.get("system_fingerprint") or "")
    if match is None:
        raise ValueError(f"reply has no clawr1 system_fingerprint: {reply.get('system_fingerprint')!r}")
    return int(match.group(1))


async def _wait_healthy(server: Server, base: str, timeout: float) -> None:
    deadline = time.perf_counter() + timeout
    last = "no answer"
    async with httpx.AsyncClient(base_url=base, timeout=5) as http:
        while time.perf_counter() < deadline:
            if server.proc.poll() is not None:
                raise RuntimeError(f"the gateway exited with {server.proc.returncode}:\n{server.log_tail()}")
            try:
                if (await http.get("/healthz")).status_code == 200:
                    return
            except httpx.TransportError as exc:  # not listening yet
                last = str(exc)
            await asyncio.sleep(0.1)
    raise RuntimeError(f"the gateway was not ready after {timeout:.0f}s ({last}):\n{server.log_tail()}")


async def _watch(server: Server, tasks: list[asyncio.Task], seconds: float) -> None:
    """Sleep, but fail fast if the gateway dies or a client crashes (a bug, not a failed request)."""
    deadline = time.perf_counter() + seconds
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {server.proc.returncode}:\n{server.log_tail()}")
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        await asyncio.sleep(min(left, 0.1))


def _first_served(calls: list[Call], swap: Swap) -> float | None:
    """End of the first response from `swap.version` or newer (a version published while the one
    before was still loading may be skipped by the gateway; its successor then counts)."""
    ends = [c.end for c in calls if c.version is not None and c.version >= swap.version and c.end > swap.publish_end]
    return min(ends) if ends else None


def _attach_gateway_record(swaps: list[Swap], record: dict[str, list[Any]]) -> None:
    """The gateway's own (wall time loaded, adapter, version, load seconds), mapped onto our perf_counter clock,
    and the engine's slot loads."""
    offset = time.time() - time.perf_counter()
    by_version = {int(version): (when - offset, load_s) for when, _, version, load_s in record["gateway"]}
    slot_loads = {int(load["version"]): load for load in record["engine"]}
    for swap in swaps:
        if swap.version in by_version:
            swap.loaded_at, swap.load_s = by_version[swap.version]
        if swap.version in slot_loads:
            swap.slot_s, swap.new_slot = slot_loads[swap.version]["s"], slot_loads[swap.version]["new_slot"]


# ---- numbers and tables ----------------------------------------------------------------------------

def _stats(latencies: list[float]) -> dict[str, Any]:
    if not latencies:
        return {"n": 0}
    ordered = sorted(latencies)
    return {"n": len(ordered), "p50_ms": 1000 * percentile(ordered, 0.5), "p99_ms": 1000 * percentile(ordered, 0.99),
            "mean_ms": 1000 * statistics.fmean(ordered), "max_ms": 1000 * ordered[-1]}


def summarise(calls: list[Call], swaps: list[Swap], phases: dict[str, float], window_after_s: float) -> dict[str, Any]:
    """Failures, latency per phase, per-swap delays and the goals, as JSON-able numbers."""
    failed = [c for c in calls if c.error is not None]
    ok = [c for c in calls if c.error is None and not c.probe]  # latency: the clients' requests, not the probe's
    probes = [c for c in calls if c.error is None and c.probe]
    windows = [(s.publish_start, (s.first_served if s.first_served is not None else s.publish_end) + window_after_s)
               for s in swaps]
    in_window = [c for c in ok if any(c.start < end and c.end > begin for begin, end in windows)]
    steady = [c for c in ok if c.start >= phases["steady_start"] and c.end <= phases["steady_end"]]
    windowed = {id(c) for c in in_window}
    between = [c for c in ok if c.start >= phases["steady_end"] and id(c) not in windowed]
    per_swap = []
    for s in swaps:
        row: dict[str, Any] = {"version": s.version, "publish_ms": 1000 * (s.publish_end - s.publish_start),
                               "delay_s": None if s.first_served is None else s.first_served - s.publish_end,
                               "load_ms": None if s.load_s is None else 1000 * s.load_s,
                               "slot_ms": None if s.slot_s is None else 1000 * s.slot_s, "new_slot": s.new_slot,
                               "detect_ms": None, "first_request_ms": None}
        if s.loaded_at is not None and s.load_s is not None:
            row["detect_ms"] = 1000 * (s.loaded_at - s.load_s - s.publish_end)  # the gateway's poll + queueing
            if s.first_served is not None:
                row["first_request_ms"] = 1000 * (s.first_served - s.loaded_at)
        per_swap.append(row)
    delays = [r["delay_s"] for r in per_swap if r["delay_s"] is not None]
    numbers: dict[str, Any] = {
        "requests": len(calls), "failed": len(failed), "first_error": failed[0].error if failed else None,
        "phases": {"steady": _stats([c.end - c.start for c in steady]),
                   "swap_windows": _stats([c.end - c.start for c in in_window]),
                   "between_swaps": _stats([c.end - c.start for c in between])},
        "probe": {"steady": _stats([c.end - c.start for c in probes if phases["steady_start"] <= c.start
                                    and c.end <= phases["steady_end"]]),
                  "swap_windows": _stats([c.end - c.start for c in probes
                                          if any(c.start < end and c.end > begin for begin, end in windows)])},
        "swaps": per_swap, "unserved_swaps": sum(1 for r in per_swap if r["delay_s"] is None),
        "delay_mean_s": statistics.fmean(delays) if delays else None, "delay_max_s": max(delays) if delays else None,
    }
    steady_p99 = numbers["phases"]["steady"].get("p99_ms")
    window_p99 = numbers["phases"]["swap_windows"].get("p99_ms")
    numbers["p99_ratio"] = window_p99 / steady_p99 if steady_p99 and window_p99 is not None else None
    numbers["goals"] = {
        "failed_requests": {"value": len(failed), "limit": 0, "ok": not failed},
        "p99_swap_over_steady": {"value": numbers["p99_ratio"], "limit": GOAL_P99_RATIO,
                                 "ok": numbers["p99_ratio"] is not None and numbers["p99_ratio"] <= GOAL_P99_RATIO},
        "publish_to_serving_max_s": {"value": numbers["delay_max_s"], "limit": GOAL_DELAY_S,
                                     "ok": bool(delays) and not numbers["unserved_swaps"]
                                     and numbers["delay_max_s"] <= GOAL_DELAY_S},
    }
    return numbers


def _fmt(value: Any, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def tables(numbers: dict[str, Any]) -> list[Table]:
    setup = (f"{numbers['model']}, {numbers['clients']} clients x {numbers['max_tokens']} tokens, adapter poll "
             f"{numbers['poll_s']} s, {numbers['cpus']} CPUs shared with the clients and the publisher")
    phases = Table(title=f"Hot swap under load: {setup}")
    for column in ("phase", "requests", "p50 ms", "p99 ms", "mean ms", "max ms"):
        phases.add_column(column, justify="left" if column == "phase" else "right")
    labels = {"steady": "steady (no swaps)", "swap_windows": "overlapping a swap window",
              "between_swaps": "swap phase, outside windows"}
    rows = [(label, numbers["phases"][key]) for key, label in labels.items()]
    rows += [(f"probe (1 token), {labels[key].split(' (')[0]}", numbers["probe"][key]) for key in numbers["probe"]]
    for label, cell in rows:
        phases.add_row(label, str(cell["n"]), *(_fmt(cell.get(k)) for k in ("p50_ms", "p99_ms", "mean_ms", "max_ms")))
    phases.caption = (f"{numbers['requests']} requests, {numbers['failed']} failed"
                      + (f" (first: {numbers['first_error']})" if numbers["first_error"] else "")
                      + f"; window = publish start .. first served + {numbers['window_after_s']} s")
    swaps = Table(title="Per swap (ms): publish; gateway notices it; load as the gateway waits for it (of which "
                        "the slot load on the engine thread); first reply from it. To serving: publish end -> "
                        "that reply")
    for column in ("version", "publish", "detect", "load", "slot", "new slot", "first reply", "to serving s"):
        swaps.add_column(column, justify="right")
    for row in numbers["swaps"]:
        new_slot = "-" if row["new_slot"] is None else ("yes" if row["new_slot"] else "no")
        swaps.add_row(f"v{row['version']}", _fmt(row["publish_ms"]), _fmt(row["detect_ms"]), _fmt(row["load_ms"]),
                      _fmt(row["slot_ms"]), new_slot, _fmt(row["first_request_ms"]),
                      _fmt(row["delay_s"], 3) if row["delay_s"] is not None else "[red]never[/red]")
    swaps.caption = (f"to serving: mean {_fmt(numbers['delay_mean_s'], 3)} s, max {_fmt(numbers['delay_max_s'], 3)} s; "
                     "detect < 0: seen before publish's last fsyncs returned")
    goals = Table(title="Goals")
    for column in ("goal", "measured", "limit", "met"):
        goals.add_column(column)
    for key, goal in numbers["goals"].items():
        value = goal["value"]
        goals.add_row(key, _fmt(value, 2) if isinstance(value, float) else str(value), str(goal["limit"]),
                      "[green]yes[/green]" if goal["ok"] else "[red]no[/red]")
    return [phases, swaps, goals]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Hot-swap benchmark (or, with --serve-*, its gateway process).")
    parser.add_argument("--serve-port", type=int, help="internal: serve the gateway on this port")
    parser.add_argument("--serve-config", type=Path, help="internal: the Config JSON for --serve-port")
    parser.add_argument("--swaps-out", type=Path, help="internal: where the gateway writes its swap record")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--steady-s", type=float, default=45.0)
    parser.add_argument("--swaps", type=int, default=8)
    parser.add_argument("--swap-every-s", type=float, default=6.0)
    parser.add_argument("--json", action="store_true", help="also print the numbers as JSON")
    args = parser.parse_args(argv)
    if args.serve_port is not None:
        serve(args.serve_config, args.serve_port, args.swaps_out)
        return
    numbers = run(load_config(), clients=args.clients, max_tokens=args.max_tokens, steady_s=args.steady_s,
                  swaps=args.swaps, swap_every_s=args.swap_every_s)
    if args.json:
        print(json.dumps(numbers))


if __name__ == "__main__":
    main()
