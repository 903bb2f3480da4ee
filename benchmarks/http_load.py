"""What the HTTP benchmarks share (`gateway`, `latency`, `swap`, `crash`): a target server in its own
process (`start`, `Server`: its port, key, log and CPU seconds) and a load generator that speaks raw
HTTP/1.1 over keep-alive asyncio streams (an HTTP client library would cost more than the fake
backend it measures)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import socket
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from benchmarks import child_env
from benchmarks.fake import REPLY

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Say hello in one short sentence."}]


# ---- servers ---------------------------------------------------------------------------------------

@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen
    log: Path
    token: str | None = None  # bearer key the target wants

    def stop(self, timeout: float = 30.0) -> int:
        """SIGINT (every server here shuts down gracefully on it) and wait; kill if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired as exc:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"{self.name} did not stop within {timeout:.0f}s; killed. Log: {self.log}") from exc
        return self.proc.returncode

    def log_tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def cpu_seconds(self) -> float | None:
        """User + system CPU of the server process and its child processes (the workers and front
        of `gateway.workers`), all threads (Linux /proc; None elsewhere)."""
        if not Path(f"/proc/{self.proc.pid}/stat").exists():
            return None
        stats = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rpartition(")")[2].split()  # after "pid (comm)"; comm may hold spaces
            except OSError:  # a process that ended meanwhile
                continue
            stats[int(stat.parent.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])))  # ppid, utime + stime
        tree, grown = {self.proc.pid}, True
        while grown:  # descendants, whatever their pids
            grown = False
            for pid, (ppid, _) in stats.items():
                if ppid in tree and pid not in tree:
                    tree.add(pid)
                    grown = True
        total = sum(stats[pid][1] for pid in tree if pid in stats)
        return total / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, argv: list[str], workdir: Path, env: dict[str, str] | None = None,
          token: str | None = None) -> Server:
    port = free_port()
    log = workdir / f"{name}.log"
    with log.open("wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen([a.replace("{port}", str(port)) for a in argv], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=child_env(env), cwd=workdir)
    return Server(name, port, proc, log, token)


# ---- load generator --------------------------------------------------------------------------------

def request_bytes(port: int, stream: bool, token: str | None) -> bytes:
    body = json.dumps({"model": "fake", "messages": MESSAGES, "max_tokens": 16, "stream": stream}).encode()
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"{auth}Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)")
_REPLY = REPLY.encode()


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   payload: bytes) -> tuple[int, bytes, bool]:
    """One request on a keep-alive connection: (status, body, whether the connection stays open).
    Reads content-length and chunked bodies."""
    writer.write(payload)
    head = (await reader.readuntil(b"\r\n\r\n")).lower()
    status = int(head[9:12])
    if b"\r\ntransfer-encoding: chunked" in head:
        parts = []
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            parts.append((await reader.readexactly(size + 2))[:-2])
        await reader.readuntil(b"\r\n")  # the empty line after the last chunk (no trailers here)
        body = b"".join(parts)
    else:
        match = _LENGTH.search(head)
        body = await reader.readexactly(int(match.group(1))) if match else b""
    return status, body, b"\r\nconnection: close" not in head


def reply_ok(body: bytes, stream: bool) -> bool:
    """The fixed reply came through: its text (plain) or a stream ending in [DONE]."""
    return body.rstrip().endswith(b"data: [DONE]") if stream else _REPLY in body


@dataclass
class Load:
    """Requests on `concurrency` keep-alive connections to one target; counts what it answered."""

    server: Server
    stream: bool
    concurrency: int
    served: Counter  # good replies by target name, across Loads
    errors: list[str] = field(default_factory=list)
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = field(default_factory=list)
    payload: bytes = b""

    async def __aenter__(self) -> Self:
        self.payload = request_bytes(self.server.port, self.stream, self.server.token)
        self.conns = [await asyncio.open_connection("127.0.0.1", self.server.port) for _ in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for _, writer in self.conns:
            writer.close()
        await asyncio.gather(*(w.wait_closed() for _, w in self.conns), return_exceptions=True)

    async def run(self, count: int, seconds: float) -> tuple[list[float], float]:
        """Up to `count` requests or `seconds`; (latencies in ms of good replies, wall seconds)."""
        latencies: list[float] = []
        left = count
        deadline = time.perf_counter() + seconds

        async def worker(i: int) -> None:
            nonlocal left
            while left > 0 and time.perf_counter() < deadline:
                left -= 1
                reader, writer = self.conns[i]
                t0 = time.perf_counter()
                try:
                    status, body, keep_alive = await exchange(reader, writer, self.payload)
                except (ConnectionError, asyncio.IncompleteReadError) as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    status, body, keep_alive = 0, b"", False
                if status == 200 and reply_ok(body, self.stream):
                    latencies.append((time.perf_counter() - t0) * 1000)
                    self.served[self.server.name] += 1
                elif status:
                    self.errors.append(f"HTTP {status}: {body[:200]!r}")
                if not keep_alive:
                    writer.close()
                    self.conns[i] = await asyncio.open_connection("127.0.0.1", self.server.port)

        start = time.perf_counter()
        async with asyncio.timeout(seconds + 120):  # a hung server fails the run instead of stalling it
            await asyncio.gather(*(worker(i) for i in range(self.concurrency)))
        return latencies, time.perf_counter() - start


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


async def wait_ready(server: Server, served: Counter, timeout: float) -> None:
    """Until the target answers a real completion (LiteLLM needs ~15 s to start)."""
    deadline = time.perf_counter() + timeout
    last = "no answer"
    while time.perf_counter() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            async with Load(server, False, 1, served) as load:
                await load.run(1, 30)
                if not load.errors:
                    return
                last = load.errors[-1]
        except OSError as exc:  # not listening yet
            last = str(exc)
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{server.name} not ready after {timeout:.0f}s ({last}):\n{server.log_tail()}")


async def measure(server: Server, stream: bool, concurrency: int, requests: int, seconds: float,
                  served: Counter) -> dict[str, Any]:
    async with Load(server, stream, concurrency, served) as load:
        await load.run(max(2 * concurrency, requests // 20), min(2.0, seconds / 2))  # warm-up, discarded
        warm_errors = len(load.errors)
        cpu = server.cpu_seconds()
        latencies, wall = await load.run(requests, seconds)
        cpu_after = server.cpu_seconds()
    latencies.sort()
    cell: dict[str, Any] = {"n": len(latencies), "errors": len(load.errors) - warm_errors,
                            "req_s": len(latencies) / wall if wall > 0 else 0.0}
    if cpu is not None and cpu_after is not None and latencies:
        # The server's own CPU a request: on cores shared with the load generator, the number that transfers.
        cell["cpu_ms"] = (cpu_after - cpu) * 1000 / len(latencies)
    if latencies:
        cell.update(p50_ms=percentile(latencies, 0.5), p99_ms=percentile(latencies, 0.99),
                    mean_ms=sum(latencies) / len(latencies))
    if load.errors:
        cell["first_error"] = load.errors[0]
    return cell
