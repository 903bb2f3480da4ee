"""`clawr1 bench scale`: what scaling out buys on this machine, measured side by side in one run.

1. Serving: `clawr1 up --ray` (a local Ray instance, the configured model) with 1 and then 2
   engine replicas; `clients` concurrent clients, each its own session (so the router spreads
   them), for `duration_s`; req/s, p50 and p99 through the gateway.
2. Pool writes: 1 and 2 gateway processes appending steps at once (8 threads each, as concurrent
   requests), on one SQLite file and on one PostgreSQL database; committed steps/s over all of them.
   PostgreSQL is a throwaway local server unless `--postgres-dsn` names one.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from benchmarks import child_env
from clawr1.core.config import Config


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_through(replicas: int, model: str, workdir: Path, *, clients: int, duration_s: float,
                  max_tokens: int) -> dict[str, Any]:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    up = subprocess.Popen([sys.executable, "-m", "clawr1.cli.main", "up", "--ray", "--model", model, "--data-dir",
                           str(workdir / f"r{replicas}"), "--port", str(port), "--set", f"ray.replicas={replicas}",
                           "--set", "trainer.batch_size=4096", "--set", "trainer.max_wait_s=3600"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 600
        while not _answers(base):
            if up.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"clawr1 up --ray with {replicas} replica(s) did not start")
            time.sleep(1)
        body = {"model": "m", "max_tokens": max_tokens, "temperature": 0.7}
        for i in range(clients):  # warm every replica's code paths
            httpx.post(f"{base}/v1/chat/completions", timeout=600, headers={"X-Session-Id": f"warm-{i}"},
                       json={**body, "messages": [{"role": "user", "content": "warm up"}]}).raise_for_status()
        latencies: list[float] = []
        failures = 0
        stop_at = time.perf_counter() + duration_s

        def client(k: int) -> None:
            nonlocal failures
            n = 0
            with httpx.Client(timeout=600) as http:
                while time.perf_counter() < stop_at:
                    started = time.perf_counter()
                    response = http.post(f"{base}/v1/chat/completions", headers={"X-Session-Id": f"c{k}"}, json={
                        **body, "messages": [{"role": "user", "content": f"Tell me a fact about number {n}."}]})
                    if response.status_code == 200:
                        latencies.append(time.perf_counter() - started)
                    else:
                        failures += 1
                    n += 1

        started = time.perf_counter()
        threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
    finally:
        up.terminate()
        up.wait(timeout=120)
    latencies.sort()
    return {"replicas": replicas, "requests": len(latencies), "failures": failures, "req_per_s": len(latencies) / wall,
            "p50_s": statistics.median(latencies), "p99_s": latencies[min(len(latencies) - 1, int(len(latencies) * .99))]}


def _answers(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


WRITER = "benchmarks.scale"


def writer_main(backend: str, where: str, gateway: int, steps: int, start_at: float) -> None:
    """One gateway process: `steps` steps of its own sessions from 8 threads; prints its timings."""
    from benchmarks.pool import bench_step
    from clawr1.datapool.postgres import PostgresPool
    from clawr1.datapool.sqlite import SQLitePool

    pool = PostgresPool(where) if backend == "postgres" else SQLitePool(Path(where))
    batch = [bench_step(gateway * 10_000_000 + i) for i in range(steps)]
    for step in batch:  # each gateway its own sessions, as session-affine routing gives
        step.step_id = f"g{gateway}-{step.step_id}"
    time.sleep(max(0.0, start_at - time.time()))
    began = time.time()
    with ThreadPoolExecutor(8) as executor:
        futures = [f for chunk in executor.map(lambda c: [pool.submit_step(s) for s in c], [batch[k::8] for k in range(8)])
                   for f in chunk]
        assert all(f.result() for f in futures)
    print(json.dumps({"began": began, "ended": time.time()}), flush=True)
    pool.close()


def pool_writes(backend: str, where: str, gateways: int, steps: int) -> dict[str, Any]:
    start_at = time.time() + 3.0  # every process has loaded and built its steps by then
    procs = [subprocess.Popen([sys.executable, "-m", WRITER, "--writer", backend, where, str(g), str(steps),
                               str(start_at)], stdout=subprocess.PIPE, text=True, env=child_env())
             for g in range(gateways)]
    outs = [json.loads(p.communicate(timeout=900)[0].strip().splitlines()[-1]) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a {backend} writer failed")
    wall = max(o["ended"] for o in outs) - min(o["began"] for o in outs)
    return {"backend": backend, "gateways": gateways, "steps": steps * gateways, "steps_per_s": steps * gateways / wall}


def run(config: Config, console: Console, *, duration_s: float = 20.0, clients: int = 8, max_tokens: int = 32,
        steps: int = 5000, postgres_dsn: str | None = None) -> dict[str, Any]:
    from clawr1.engine.models import resolve_model

    model = str(resolve_model(config.engine.model, config.data_dir))
    numbers: dict[str, Any] = {"serving": [], "pool": []}
    with tempfile.TemporaryDirectory(prefix="clawr1-bench-scale-") as tmp:
        work = Path(tmp)
        for replicas in (1, 2):
            with console.status(f"serving through {replicas} engine replica(s) for {duration_s:.0f} s ..."):
                numbers["serving"].append(serve_through(replicas, model, work, clients=clients, duration_s=duration_s,
                                                        max_tokens=max_tokens))
        server = None
        if postgres_dsn is None:
            from clawr1.datapool.pgserver import LocalPostgres, PostgresUnavailable

            try:
                server = LocalPostgres()
            except PostgresUnavailable as exc:
                console.print(f"[yellow]PostgreSQL skipped:[/yellow] {exc}")
        try:
            for gateways in (1, 2):
                with console.status(f"pool writes, {gateways} gateway(s) ..."):
                    numbers["pool"].append(pool_writes("sqlite", str(work / f"sqlite-{gateways}"), gateways, steps))
                    if server is not None or postgres_dsn:
                        numbers["pool"].append(pool_writes("postgres", postgres_dsn or server.fresh(), gateways, steps))
        finally:
            if server is not None:
                server.stop()
    serving = numbers["serving"]
    table = Table("engine replicas", "req/s", "p50", "p99", "failed", "vs 1 replica",
                  title=f"Serving through `clawr1 up --ray` ({clients} clients, {max_tokens} tokens each)")
    for row in serving:
        table.add_row(str(row["replicas"]), f"{row['req_per_s']:.2f}", f"{row['p50_s']:.2f} s", f"{row['p99_s']:.2f} s",
                      str(row["failures"]), f"{row['req_per_s'] / serving[0]['req_per_s']:.2f}x")
    console.print(table)
    table = Table("pool", "gateways", "committed steps/s", "vs 1 gateway", title=f"Pool writes ({steps:,} steps a gateway)")
    for row in numbers["pool"]:
        one = next(r for r in numbers["pool"] if r["backend"] == row["backend"] and r["gateways"] == 1)
        table.add_row(row["backend"], str(row["gateways"]), f"{row['steps_per_s']:,.0f}",
                      f"{row['steps_per_s'] / one['steps_per_s']:.2f}x")
    console.print(table)
    return numbers


if __name__ == "__main__":
    if sys.argv[1] == "--writer":
        writer_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]))
