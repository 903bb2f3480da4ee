"""`clawr1 bench crash`: the window between a reply and its commit, measured with `kill -9` under load.

For each setting of `gateway.durable_reply` (off, then on), `cycles` times: start the gateway
process (the benchmark's fake engine, a real SQLite pool in one data dir per setting), drive it with
`clients` keep-alive connections of plain chat requests, SIGKILL it after a random 0.2-0.8 s while
replies are going out, then open the pool and look up the step of every reply a client received.
A reply whose step is missing is a step the client saw and the pool lost. Prints replies received
vs steps lost per setting.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from benchmarks.http_load import Server, exchange, request_bytes, start
from clawr1.core.config import Config
from clawr1.datapool import POOL_FILE


async def _load(server: Server, clients: int, received: list[str], stop: asyncio.Event) -> None:
    """Plain requests on `clients` connections until the server dies; collects every reply's id."""
    payload = request_bytes(server.port, stream=False, token=None)

    async def client() -> None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        except OSError:
            return
        try:
            while not stop.is_set():
                status, body, _ = await exchange(reader, writer, payload)
                if status == 200:
                    received.append(json.loads(body)["id"])
        except (OSError, asyncio.IncompleteReadError, ValueError):
            return  # the server was killed: whatever was not fully received does not count
        finally:
            writer.close()

    await asyncio.gather(*[client() for _ in range(clients)])


def _wait_ready(server: Server, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"http://127.0.0.1:{server.port}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise TimeoutError("the gateway did not start")


async def _cycle(config_json: Path, workdir: Path, clients: int, rng: random.Random) -> list[str]:
    server = start("crash", [sys.executable, "-m", "benchmarks.gateway", "--serve-port", "{port}",
                             "--serve-config", str(config_json)], workdir)
    try:
        await asyncio.to_thread(_wait_ready, server)
        received: list[str] = []
        stop = asyncio.Event()
        load = asyncio.create_task(_load(server, clients, received, stop))
        await asyncio.sleep(rng.uniform(0.2, 0.8))
        os.kill(server.proc.pid, signal.SIGKILL)  # mid-load: replies are on the wire
        stop.set()
        await load
        return received
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        server.proc.wait()


def _missing(data_dir: Path, reply_ids: list[str]) -> int:
    """How many received replies have no step in the pool (step id = reply id + `-0`)."""
    db = sqlite3.connect(data_dir / POOL_FILE)
    try:
        stored = {row[0] for row in db.execute("SELECT step_id FROM steps")}
    finally:
        db.close()
    return sum(1 for rid in reply_ids if f"{rid}-0" not in stored)


def run(config: Config, console: Console | None = None, cycles: int = 50, clients: int = 16,
        seed: int = 0) -> dict[str, Any]:
    console = console or Console()
    rng = random.Random(seed)
    numbers: dict[str, Any] = {"cycles": cycles, "clients": clients, "settings": {}}
    with tempfile.TemporaryDirectory(prefix="clawr1-bench-crash-") as tmp, Progress(console=console,
                                                                                     transient=True) as progress:
        for durable in (False, True):
            name = "durable_reply on" if durable else "durable_reply off"
            data_dir = Path(tmp) / name.replace(" ", "-")
            config_json = Path(tmp) / f"{data_dir.name}.json"
            config_json.write_text(config.model_copy(update={"data_dir": data_dir, "gateway": config.gateway.model_copy(
                update={"durable_reply": durable})}).model_dump_json())
            task = progress.add_task(name, total=cycles)
            received = lost = 0
            per_cycle = []
            for _ in range(cycles):
                ids = asyncio.run(_cycle(config_json, Path(tmp), clients, rng))
                missing = _missing(data_dir, ids)
                received, lost = received + len(ids), lost + missing
                per_cycle.append(missing)
                progress.advance(task)
            numbers["settings"][name] = {"replies_received": received, "steps_lost": lost,
                                         "cycles_with_loss": sum(1 for m in per_cycle if m)}
    table = Table(title=f"kill -9 under load: {cycles} cycles x {clients} clients (plain chat, fake engine)")
    for column in ("setting", "replies received", "steps lost", "cycles with a loss"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for name, row in numbers["settings"].items():
        table.add_row(name, f"{row['replies_received']:,}", str(row["steps_lost"]), str(row["cycles_with_loss"]))
    console.print(table)
    return numbers
