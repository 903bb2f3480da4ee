"""Gateway benchmark: what the gateway adds over calling a backend directly, next to other proxies.

Targets, each in its own process so the load generator never shares a GIL with a server:
- `direct`: the fake OpenAI-compatible backend (`benchmarks.fake`), answering a fixed 16-token reply;
- `passthrough`: a minimal aiohttp proxy in front of it (`benchmarks.passthrough`), the lean floor;
- `gateway`: ours, `create_app(FakeEngine(), SQLitePool(tmp), config)` under uvicorn, recording on;
- `gateway xN`: with `--workers N`, ours as `clawr1 serve` runs it with `gateway.workers = N` (a
  front process and N gateway processes, each on the fake engine), beside the single process;
- `litellm`: LiteLLM's proxy in front of the fake backend, when the `litellm` executable is found
  (`$CLAWR1_LITELLM` or PATH; install `litellm[proxy]` in a separate venv).

The load generator speaks raw HTTP/1.1 over keep-alive asyncio streams (an HTTP client library would
cost more than the fake backend). For each target, mode (plain, `stream: true` read to `[DONE]`) and
client count: a warm-up, then `requests` requests (or `seconds`, whichever ends first); p50/p99 per
request and req/s. Added latency = target minus direct. Afterwards the gateway's pool must hold one
step per request it answered: the numbers are with recording on, and proven so.

Three rounds by default. In each, every server starts afresh and the targets take turns cell by
cell (the order reversed every other round), so the cells compared are measured seconds apart and a
shared machine's slow spells hit them alike: each number is the median of its rounds, and our req/s
over the pass-through's is taken round by round and printed side by side with its median.
`--profile N`: afterwards, one more gateway process under cProfile at the most clients, plain then
streamed, and its N costliest functions by own time (what the rest costs; not counted in the
numbers: the profiler slows it about twofold).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from benchmarks.fake import run_loop
from benchmarks.http_load import Server, measure, start, wait_ready
from clawr1.core.config import Config, load_config

MODES = ("plain", "stream")
OURS, DIRECT = "gateway", "direct"
REPLY_FIRST = "gateway, reply before commit"  # `gateway.durable_reply = false`, measured beside (`--durable both`)
LITELLM_KEY = "sk-clawr1-bench-" + "0" * 32  # LiteLLM refuses to start without a master key
LITELLM_MISSING = ("LiteLLM not installed (pip install 'litellm[proxy]' in a separate venv and set "
                   "CLAWR1_LITELLM=/path/to/litellm)")
GOAL_ADDED_P50_MS, GOAL_ADDED_P99_MS, GOAL_REQ_S = 0.5, 5.0, 1500.0  # added p50: 1.0 until the pipeline issue
GOAL_VS_PASSTHROUGH, GOAL_CPU_MS = 0.5, 0.25  # req/s at the most clients, ÷ the pass-through's; server CPU a request


def find_litellm() -> str | None:
    return os.environ.get("CLAWR1_LITELLM") or shutil.which("litellm")


def litellm_argv(executable: str, upstream_port: int, workdir: Path) -> list[str]:
    config = workdir / "litellm.yaml"
    config.write_text(f"""model_list:
  - model_name: fake
    litellm_params:
      model: openai/fake
      api_base: http://127.0.0.1:{upstream_port}/v1
      api_key: unused
litellm_settings:
  drop_params: true
general_settings:
  master_key: {LITELLM_KEY}
""")
    return [executable, "--config", str(config), "--host", "127.0.0.1", "--port", "{port}", "--num_workers", "1"]


def serve_gateway(config_json: Path, port: int, profile: Path | None = None) -> None:
    """The `gateway` target's process: our app on the fake engine, recording into `config.data_dir`.
    `profile`: serve under cProfile (its event loop thread) and write its stats there at the end."""
    import importlib.util

    from benchmarks.fake import FakeEngine
    from clawr1.datapool import open_pool
    from clawr1.entrypoints.server import make_server, tune_gc
    from clawr1.gateway.app import create_app

    config = Config.model_validate_json(config_json.read_text())
    if config.gateway.workers > 1:  # as `clawr1 serve` runs them, each worker on the fake engine
        from clawr1.entrypoints.serve import serve

        config = config.model_copy(update={"gateway": config.gateway.model_copy(update={"port": port})})
        try:
            asyncio.run(serve(config, on_ready=lambda *_: None, engine_spec="benchmarks.fake:FakeEngine"))
        except KeyboardInterrupt:
            pass
        return
    pool = open_pool(config)  # as `clawr1 serve` opens it (with durable replies: no commit linger)
    # uvloop + httptools when installed: what `clawr1 serve` (uvicorn's "auto") runs on.
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    app = create_app(FakeEngine(), pool, config)
    tune_gc()  # as `clawr1 serve` does
    server = make_server(app, port=port, loop=loop, http=http, lifespan="on")
    profiler = None
    if profile is not None:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        server.run()
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the SIGINT that stopped it after a graceful shutdown: the normal end
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)
        pool.close()  # commits every queued step before the process exits


# ---- the run -----------------------------------------------------------------------------------------

def run(config: Config, console: Console | None = None, requests: int = 2000, concurrency: tuple[int, ...] = (1, 64),
        include_litellm: bool = True, seconds: float = 5.0, durable_both: bool = False,
        workers: int = 1, fronts: int = 1, rounds: int = 3, profile: int = 0) -> dict[str, Any]:
    """Run the benchmark, print tables of results, ratios and goals, and return the numbers.
    `durable_both`: also run our gateway with `durable_reply` off, to price the commit-before-reply.
    `workers` > 1: also run it with `gateway.workers = workers` (and `gateway.fronts = fronts`), for
    the scaling. `rounds` > 1: every target is measured that many times, the targets taking turns
    cell by cell (so a slow spell of a shared machine hits them alike), and each number is the
    median of its rounds: on two shared cores one round's CPU a request varies by about 10%, and on
    a loaded machine one round's ratio to the pass-through by half. `profile` > 0: then
    profile one more gateway process and print its `profile` costliest functions."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    console = console or Console()
    with tempfile.TemporaryDirectory(prefix="clawr1-bench-gateway-") as tmp:
        numbers = run_loop(_bench(config, console, Path(tmp), requests, tuple(concurrency), include_litellm, seconds,
                                  durable_both, workers, fronts, rounds, profile))
    _summarise(numbers)
    for table in _tables(numbers):
        console.print(table)
    return numbers


async def _bench(config: Config, console: Console, workdir: Path, requests: int, concurrency: tuple[int, ...],
                 include_litellm: bool, seconds: float, durable_both: bool = False, workers: int = 1,
                 fronts: int = 1, rounds: int = 1, profile: int = 0) -> dict[str, Any]:
    data_dir = workdir / "data"
    config_json = workdir / "config.json"
    config_json.write_text(config.model_copy(update={"data_dir": data_dir}).model_dump_json())
    fast_dir, fast_json = workdir / "data-reply-first", workdir / "config-reply-first.json"
    fast = config.model_copy(update={"data_dir": fast_dir, "gateway": config.gateway.model_copy(
        update={"durable_reply": False})})
    fast_json.write_text(fast.model_dump_json())
    many_dir, many_json, many = workdir / "data-workers", workdir / "config-workers.json", f"{OURS} x{workers}"
    many_json.write_text(config.model_copy(update={"data_dir": many_dir, "gateway": config.gateway.model_copy(
        update={"workers": workers, "fronts": fronts})}).model_dump_json())
    litellm = find_litellm() if include_litellm else None
    numbers: dict[str, Any] = {
        "requests": requests, "seconds": seconds, "concurrency": list(concurrency), "reply_tokens": 16,
        "cpus": os.cpu_count(), "rounds": rounds, "targets": {},
        "litellm": "included" if litellm else ("not requested" if not include_litellm else LITELLM_MISSING),
    }
    served: Counter = Counter()
    cells = [(mode, c) for mode in MODES for c in concurrency]
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, refresh_per_second=4, transient=True)
    task = progress.add_task("starting", total=(3 + bool(litellm) + durable_both + (workers > 1)) * len(cells) * rounds
                             + (len(MODES) if profile else 0))
    measured: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}  # target -> mode -> clients -> rounds

    async def bench_cell(server: Server, mode: str, c: int) -> None:
        progress.update(task, description=f"{server.name}: {mode}, {c} client(s)")
        cell = await measure(server, mode == "stream", c, requests, seconds, served)
        measured.setdefault(server.name, {}).setdefault(mode, {}).setdefault(str(c), []).append(cell)
        progress.advance(task)

    py = sys.executable
    with progress:
        backend = start(DIRECT, [py, "-m", "benchmarks.fake", "--port", "{port}"], workdir)
        try:
            upstream = f"http://127.0.0.1:{backend.port}"
            token = config.gateway.api_keys[0] if config.gateway.api_keys else None

            def ours(name: str, settings: Path) -> Callable[[], Server]:
                """Our gateway with the config at `settings` (`serve_gateway`)."""
                return lambda: start(name, [py, "-m", "benchmarks.gateway", "--serve-port", "{port}",
                                            "--serve-config", str(settings)], workdir, token=token)

            launchers = {
                "passthrough": lambda: start("passthrough", [py, "-m", "benchmarks.passthrough", "--port", "{port}",
                                                             "--upstream", upstream], workdir),
                OURS: ours(OURS, config_json),
            }
            if durable_both:
                launchers[REPLY_FIRST] = ours(REPLY_FIRST, fast_json)
            if workers > 1:
                launchers[many] = ours(many, many_json)
            if litellm:
                # A local cost map: no network fetch (and no stall) at startup.
                launchers["litellm"] = lambda: start(
                    "litellm", litellm_argv(litellm, backend.port, workdir), workdir,
                    {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}, token=LITELLM_KEY)
            await wait_ready(backend, served, 180)
            # Each round starts every proxy afresh, then measures cell by cell, every target in
            # turn: one load at a time (an idle server only waits on its sockets), and the cells
            # that are compared measured seconds apart, not minutes, on a machine whose load
            # drifts. The order turns around every round, so no target always goes first.
            for r in range(rounds):
                servers: list[Server] = []
                try:
                    for name, launch in launchers.items():
                        progress.update(task, description=f"starting {name}")
                        servers.append(launch())
                        await wait_ready(servers[-1], served, 180)  # LiteLLM needs ~15 s on two cores
                    order = [backend, *servers]
                    for mode, c in cells:
                        for server in order if r % 2 == 0 else order[::-1]:
                            await bench_cell(server, mode, c)
                finally:
                    codes = _stop_all(servers)
                for server in servers:
                    if server.name in (OURS, REPLY_FIRST, many) and codes[server.name] != 0:
                        raise RuntimeError(f"the gateway exited with {codes[server.name]}:\n{server.log_tail()}")
            if profile:
                numbers["profile"] = await _profile(config, workdir, token, max(concurrency), requests, seconds,
                                                    served, profile, lambda mode: (
                                                        progress.update(task, description=f"profiling: {mode}"),
                                                        progress.advance(task)))
        finally:
            backend.stop()
    numbers["targets"] = {name: {mode: {c: _median_cell(runs) for c, runs in by_c.items()} for mode, by_c in modes.items()}
                          for name, modes in measured.items()}
    # Each round's req/s as well: our ratio to the pass-through is taken round by round.
    numbers["per_round"] = {name: {mode: {c: [cell["req_s"] for cell in runs] for c, runs in by_c.items()}
                                   for mode, by_c in modes.items()} for name, modes in measured.items()}
    numbers["recording"] = _recorded(config, data_dir, served[OURS])
    if durable_both:
        numbers["recording_reply_first"] = _recorded(fast, fast_dir, served[REPLY_FIRST])
    if workers > 1:
        numbers["workers"], numbers["fronts"] = workers, fronts
        numbers["recording_workers"] = _recorded(config, many_dir, served[many])
    return numbers


def _stop_all(servers: list[Server]) -> dict[str, int | None]:
    """Stop every server (each one's exit code, None where it did not stop); the first error
    stopping one is raised once all were tried."""
    codes: dict[str, int | None] = {}
    error: Exception | None = None
    for server in servers:
        try:
            codes[server.name] = server.stop()
        except Exception as exc:  # noqa: BLE001 - raised below, once the others are stopped too
            codes[server.name], error = None, error or exc
    if error is not None:
        raise error
    return codes


PROFILED = "gateway (profiled)"


async def _profile(config: Config, workdir: Path, token: str | None, clients: int, requests: int, seconds: float,
                   served: Counter, top: int, step: Callable[[str], Any]) -> dict[str, Any]:
    """One more gateway process under cProfile, loaded as a measured cell (plain, then streamed, at
    `clients`): its `top` functions by own time, each with its share of the profiled time, and
    the requests it answered (calls a request = calls / requests)."""
    import pstats

    data_dir, settings, stats = workdir / "data-profiled", workdir / "config-profiled.json", workdir / "gateway.prof"
    settings.write_text(config.model_copy(update={"data_dir": data_dir}).model_dump_json())
    server = start(PROFILED, [sys.executable, "-m", "benchmarks.gateway", "--serve-port", "{port}", "--serve-config",
                              str(settings), "--serve-profile", str(stats)], workdir, token=token)
    try:
        await wait_ready(server, served, 180)
        for mode in MODES:
            step(mode)
            await measure(server, mode == "stream", clients, requests, seconds, served)
    finally:
        code = server.stop()
    if code != 0:
        raise RuntimeError(f"the profiled gateway exited with {code}:\n{server.log_tail()}")
    # (file, line, function) -> (primitive calls, calls, own s, cumulative s, callers)
    entries = pstats.Stats(str(stats)).stats  # type: ignore[attr-defined]
    rows = sorted(((own, calls, cumulative, key) for key, (_, calls, own, cumulative, _) in entries.items()
                   if not _loop_frame(key)), reverse=True)
    # The frames that run the event loop own what uvloop does in C (polling, socket reads and
    # writes' bookkeeping, dispatching callbacks) and its idle waits: shown apart, not shared out.
    loop_s = sum(own for key, (_, _, own, _, _) in entries.items() if _loop_frame(key))
    total = sum(own for own, *_ in rows)
    answered = served[PROFILED]
    areas: Counter = Counter()  # the same own time by file (a package outside ours), for the big picture
    for own, _, _, key in rows:
        areas[_area(key)] += own
    return {"clients": clients, "requests": answered, "total_s": total, "loop_s": loop_s, "top": [
        {"function": _where(key), "own_s": own, "share": own / total if total else 0.0,
         "cumulative_s": cumulative, "calls_per_request": calls / answered if answered else 0.0}
        for own, calls, cumulative, key in rows[:top]],
        "areas": [{"area": area, "own_s": own, "share": own / total if total else 0.0}
                  for area, own in areas.most_common(top)]}


def _loop_frame(key: tuple[str, int, str]) -> bool:
    file, _, name = key
    return (file.endswith(("asyncio/runners.py", "uvicorn/_compat.py")) and name in ("run", "asyncio_run")
            or file.endswith("uvicorn/server.py") and name in ("_serve", "serve", "run"))


def _area(key: tuple[str, int, str]) -> str:
    """Our file (`clawr1/gateway/pipeline.py`), another package (`uvicorn`), a stdlib module
    (`json`), or `built-ins` (C functions the profiler times apart from their callers)."""
    if key[0] == "~":
        return "built-ins"
    if key[0] == "<string>":
        return "generated __init__s (dataclasses)"
    path = _where(key).rpartition(":")[0]
    return path if path.startswith(("clawr1/", "benchmarks/")) else path.split("/")[0].removesuffix(".py")


def _where(key: tuple[str, int, str]) -> str:
    """`file:line(function)`, the file relative to its package root (site-packages, src, the stdlib)."""
    file, line, name = key
    if file == "~":
        return name  # a built-in
    for marker in ("site-packages/", "/src/", "/lib/python3"):
        if marker in file:
            file = file.rpartition(marker)[2]
            file = file.partition("/")[2] if marker == "/lib/python3" else file
            break
    else:
        here = Path(__file__).resolve().parent  # benchmarks/
        file = f"benchmarks/{Path(file).name}" if Path(file).parent == here else Path(file).name
    return f"{file}:{line}({name})"


def _median_cell(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell from its rounds: each number the median of its rounds, requests and errors summed,
    the first error kept."""
    cell: dict[str, Any] = {"n": sum(r["n"] for r in runs), "errors": sum(r["errors"] for r in runs)}
    for key in {k for r in runs for k, v in r.items() if isinstance(v, float)}:
        cell[key] = statistics.median(r[key] for r in runs if key in r)
    errors = [r["first_error"] for r in runs if "first_error" in r]
    if errors:
        cell["first_error"] = errors[0]
    return cell


def _recorded(config: Config, data_dir: Path, served: int) -> dict[str, Any]:
    """Read the gateway's pool after its process exited (everything it queued is committed)."""
    from clawr1.datapool import SQLitePool

    pool = SQLitePool(data_dir, config.pool)
    try:
        steps = pool.stats()["steps"]
    finally:
        pool.close()
    return {"served": served, "recorded_steps": steps, "ok": steps == served}


def _summarise(numbers: dict[str, Any]) -> None:
    """Added latency over direct, our ratios to the other proxies, and the goal checks, in place."""
    targets = numbers["targets"]
    direct = targets[DIRECT]
    for name, modes in targets.items():
        if name == DIRECT:
            continue
        for mode, cells in modes.items():
            for c, cell in cells.items():
                base = direct[mode][c]
                if "p50_ms" in cell and "p50_ms" in base:
                    cell["added_p50_ms"] = cell["p50_ms"] - base["p50_ms"]
                    cell["added_p99_ms"] = cell["p99_ms"] - base["p99_ms"]
    ratios: dict[str, Any] = {}
    for other in ("passthrough", "litellm"):
        if other not in targets:
            continue
        for mode, cells in targets[OURS].items():
            for c, ours in cells.items():
                theirs = targets[other][mode][c]
                ratio = {"req_s": ours["req_s"] / theirs["req_s"] if theirs["req_s"] else None,
                         # how many times less latency we add (None when we add none to divide by)
                         "added_p50": (theirs.get("added_p50_ms", 0) / ours["added_p50_ms"]
                                       if ours.get("added_p50_ms", 0) > 0 else None),
                         # the server CPU a request: machine speed cancels out of it, unlike the ms
                         "cpu": (theirs["cpu_ms"] / ours["cpu_ms"] if ours.get("cpu_ms") and "cpu_ms" in theirs
                                 else None)}
                ratios.setdefault(other, {}).setdefault(mode, {})[c] = ratio
    numbers["ratios"] = ratios
    # Round by round: ours ÷ the pass-through's req/s, the two measured a minute apart in each round.
    per_round = numbers.get("per_round", {})
    if "passthrough" in per_round and OURS in per_round:
        numbers["round_ratios"] = {mode: {c: _round_ratios(runs, per_round["passthrough"][mode][c])
                                          for c, runs in cells.items()} for mode, cells in per_round[OURS].items()}
    if numbers.get("workers", 1) > 1:  # gateway.workers = N against the one process, same run
        several = targets[f"{OURS} x{numbers['workers']}"]
        numbers["scaling"] = {mode: {c: several[mode][c]["req_s"] / cell["req_s"] if cell["req_s"] else None
                                     for c, cell in cells.items()} for mode, cells in targets[OURS].items()}
    one, many = str(numbers["concurrency"][0]), str(numbers["concurrency"][-1])
    plain = targets[OURS]["plain"]
    if REPLY_FIRST in targets:  # what committing before the reply costs, from the same run
        numbers["durable_cost_ms"] = {mode: {c: targets[OURS][mode][c]["p50_ms"] - targets[REPLY_FIRST][mode][c]["p50_ms"]
                                             for c in cells} for mode, cells in targets[OURS].items()}
    goals = {
        f"added_p50_ms_at_{one}": _goal(plain[one].get("added_p50_ms"), GOAL_ADDED_P50_MS, below=True),
        f"added_p99_ms_at_{one}": _goal(plain[one].get("added_p99_ms"), GOAL_ADDED_P99_MS, below=True),
        f"req_s_at_{many}": _goal(plain[many]["req_s"], GOAL_REQ_S, below=False),
        f"cpu_ms_at_{many}": _goal(plain[many].get("cpu_ms"), GOAL_CPU_MS, below=True),
    }
    if "round_ratios" in numbers:  # the median of the rounds' ratios, plain and streamed
        for mode in MODES:
            goals[f"req_s_vs_passthrough_at_{many}" + ("" if mode == "plain" else f", {mode}")] = _goal(
                numbers["round_ratios"][mode][many]["median"], GOAL_VS_PASSTHROUGH, below=False)
    if REPLY_FIRST in targets:
        goals[f"added_p50_ms_at_{one}, reply first"] = _goal(targets[REPLY_FIRST]["plain"][one].get("added_p50_ms"),
                                                            GOAL_ADDED_P50_MS, below=True)
    goals["recording"] = {"value": numbers["recording"]["recorded_steps"], "limit": numbers["recording"]["served"],
                          "ok": numbers["recording"]["ok"]}
    numbers["goals"] = goals


def _round_ratios(ours: list[float], theirs: list[float]) -> dict[str, Any]:
    """Ours ÷ theirs in each round (None where they served nothing), and the median of those."""
    rounds = [a / b if b else None for a, b in zip(ours, theirs, strict=True)]
    known = [r for r in rounds if r is not None]
    return {"rounds": rounds, "median": statistics.median(known) if known else None}


def _goal(value: float | None, limit: float, below: bool) -> dict[str, Any]:
    ok = value is not None and (value <= limit if below else value >= limit)
    return {"value": value, "limit": limit, "ok": ok}


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _tables(numbers: dict[str, Any]) -> list[Table]:
    conc = [str(c) for c in numbers["concurrency"]]
    setup = f"fake backend: {numbers['reply_tokens']}-token reply; {numbers['cpus']} CPUs shared with the load client"
    main = Table(title=f"Gateway benchmark: {setup}. ms; +: added over direct; cpu/req: the server process's own")
    for column in ("target", "mode", "clients", "p50", "p99", "+p50", "+p99", "req/s", "cpu/req", "errors"):
        main.add_column(column, justify="left" if column in ("target", "mode") else "right")
    for name, modes in numbers["targets"].items():
        for mode, cells in modes.items():
            for c in conc:
                cell = cells[c]
                times = [_fmt(cell.get(k)) for k in ("p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms")]
                main.add_row(name, mode, c, *times, _fmt(cell["req_s"], 0), _fmt(cell.get("cpu_ms")),
                             str(cell["errors"]) if cell["errors"] else "", style="bold" if name == OURS else None)
        main.add_section()
    if numbers["litellm"] != "included":
        main.caption = f"litellm skipped: {numbers['litellm']}"
    tables = [main]
    if numbers["ratios"]:
        ratios = Table(title="Ours vs. the other proxies (req/s: ours ÷ theirs; added p50 and server CPU a "
                             "request: theirs ÷ ours; >1 = ours better)")
        ratios.add_column("vs")
        ratios.add_column("mode")
        for c in conc:
            ratios.add_column(f"req/s @{c}", justify="right")
            ratios.add_column(f"added p50 @{c}", justify="right")
            ratios.add_column(f"cpu/req @{c}", justify="right")
        for other, modes in numbers["ratios"].items():
            for mode, cells in modes.items():
                row = [other, mode]
                for c in conc:
                    row += [f"{_fmt(cells[c]['req_s'])}x", f"{_fmt(cells[c]['added_p50'])}x", f"{_fmt(cells[c]['cpu'])}x"]
                ratios.add_row(*row)
        tables.append(ratios)
    if "round_ratios" in numbers:
        n = numbers["rounds"]
        by_round = Table(title="Ours ÷ the pass-through, req/s, round by round (the two measured in turn in each "
                               "round; the goal is the median)")
        for column in ("mode", "clients", *[f"round {i + 1}" for i in range(n)], "median"):
            by_round.add_column(column, justify="left" if column == "mode" else "right")
        for mode, cells in numbers["round_ratios"].items():
            for c in conc:
                ratio = cells[c]
                by_round.add_row(mode, c, *[f"{_fmt(r)}x" for r in ratio["rounds"]], f"{_fmt(ratio['median'])}x",
                                 style="bold" if c == conc[-1] else None)
        tables.append(by_round)
    rounds = f"; each number the median of {numbers['rounds']} rounds" if numbers.get("rounds", 1) > 1 else ""
    goals = Table(title=f"Goals (plain requests unless named, recording on{rounds})")
    for column in ("goal", "measured", "limit", "met"):
        goals.add_column(column)
    for key, goal in numbers["goals"].items():
        goals.add_row(key, _fmt(goal["value"]) if isinstance(goal["value"], float) else str(goal["value"]),
                      _fmt(goal["limit"]) if isinstance(goal["limit"], float) else str(goal["limit"]),
                      "[green]yes[/green]" if goal["ok"] else "[red]no[/red]")
    tables.append(goals)
    if "scaling" in numbers:
        scaling = Table(title=f"gateway.workers = {numbers['workers']}, fronts = {numbers['fronts']}: req/s ÷ one "
                              f"process's, same run "
                              f"({numbers['cpus']} CPUs, shared with the load client and the backend)")
        scaling.add_column("mode")
        for c in conc:
            scaling.add_column(f"@{c}", justify="right")
        for mode, cells in numbers["scaling"].items():
            scaling.add_row(mode, *[f"{_fmt(cells[c])}x" for c in conc])
        tables.append(scaling)
    if "profile" in numbers:
        prof = numbers["profile"]
        top = Table(title=f"Where the gateway's time goes: cProfile of one more gateway process, "
                          f"{prof['clients']} clients, plain then streamed, {prof['requests']:,} requests; own time "
                          f"of its event loop thread, the loop's own ({prof['loop_s']:.1f} s: uvloop's C work and "
                          f"idle) left out; the profiler inflates call-heavy code")
        for column in ("function", "own s", "share", "calls/request"):
            top.add_column(column, justify="left" if column == "function" else "right")
        for row in prof["top"]:
            top.add_row(row["function"], f"{row['own_s']:.3f}", f"{100 * row['share']:.1f}%",
                        f"{row['calls_per_request']:.1f}")
        tables.append(top)
        areas = Table(title="The same own time by file (ours) or package (others')")
        for column in ("file or package", "own s", "share"):
            areas.add_column(column, justify="left" if column == "file or package" else "right")
        for row in prof["areas"]:
            areas.add_row(row["area"], f"{row['own_s']:.3f}", f"{100 * row['share']:.1f}%")
        tables.append(areas)
    if "durable_cost_ms" in numbers:
        cost = Table(title="gateway.durable_reply: p50 with the commit before the reply minus p50 without (ms)")
        cost.add_column("mode")
        for c in conc:
            cost.add_column(f"@{c}", justify="right")
        for mode, cells in numbers["durable_cost_ms"].items():
            cost.add_row(mode, *[_fmt(cells[c]) for c in conc])
        tables.append(cost)
    return tables


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Gateway benchmark (or, with --serve-*, its gateway process).")
    parser.add_argument("--serve-port", type=int, help="internal: serve the gateway target on this port")
    parser.add_argument("--serve-config", type=Path, help="internal: the Config JSON for --serve-port")
    parser.add_argument("--serve-profile", type=Path, help="internal: with --serve-port, profile into this file")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--no-litellm", action="store_true")
    parser.add_argument("--durable", choices=("config", "both"), default="config")
    parser.add_argument("--workers", type=int, default=1, help="also run gateway.workers = N, for the scaling")
    parser.add_argument("--fronts", type=int, default=1, help="with --workers: gateway.fronts")
    parser.add_argument("--rounds", type=int, default=3, help="measure every target N times, in turns; medians")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="afterwards, profile one more gateway process and print its N costliest functions")
    args = parser.parse_args(argv)
    if args.serve_port is not None:
        serve_gateway(args.serve_config, args.serve_port, args.serve_profile)
    else:
        run(load_config(), requests=args.requests, seconds=args.seconds, include_litellm=not args.no_litellm,
            durable_both=args.durable == "both", workers=args.workers, fronts=args.fronts, rounds=args.rounds,
            profile=args.profile)


if __name__ == "__main__":
    main()
