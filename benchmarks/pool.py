"""Pool benchmark: committed steps/s with group commit, and the latency of leasing 64 samples.

1. Throughput. `steps` steps (a 4-message history, 200 prompt and 128 sampled token ids with
   logprobs: ~2.8 KB stored; 20 main turns a session, so next-state linking runs too) are submitted
   from 8 threads at once, as concurrent gateway requests would, and the clock stops when the last
   future resolves, i.e. when the last step is committed under the configured `synchronous`. The
   callers' encoding is included. Goal >= 20k steps/s. CPU µs a step (all threads) is reported
   too: on a machine with few or shared cores it is the number that transfers. Then the same work
   in two parts, one after the other: encoding alone (what each caller pays), and the writer alone
   on pre-encoded steps (its commit capacity when callers encode on other cores). Reference: steps
   appended one at a time, each its own transaction and fsync.
2. Lease latency. Every step is rewarded (READY); a trainer-style loop leases 64 and acks, 100
   times; p50/p99 of `lease(64)`. Goal <= 10 ms.
"""

from __future__ import annotations

import gc
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from clawr1.core.config import PoolConfig
from clawr1.core.records import Reward, Step
from clawr1.datapool import ops
from clawr1.datapool.schema import step_row
from clawr1.datapool.sqlite import SQLitePool


def bench_step(i: int, turns: int = 20) -> Step:
    """A modest agent turn: step `i` is turn `i % turns` of session `i // turns`."""
    session, turn = divmod(i, turns)
    history = [{"role": "system", "content": "You are a helpful coding agent."},
               {"role": "user", "content": f"Fix the failing test in module {session}, please."},
               {"role": "assistant", "content": "I will run the tests first."},
               {"role": "tool", "tool_call_id": f"call_{turn}", "content": "FAILED test_parse - AssertionError"}]
    return Step(step_id=f"bench-{i}", tenant="default", session_id=f"s{session}", prompt_id=f"p{session}",
                turn_index=turn, turn_type="main", messages=history, tools=None,
                prompt_ids=list(range(200)), token_ids=[(i + k) % 49_152 for k in range(128)],
                logprobs=[-0.25 - k * 1e-3 for k in range(128)], text="The parser drops the last field. " * 4,
                policy_version=0, adapter=None, finish_reason="stop", temperature=1.0, timings={"ttft_ms": 12.5})


def bench_pool(data_dir: Path, steps: int = 20_000, threads: int = 8,
               config: PoolConfig | None = None) -> dict[str, Any]:
    """Run the measurements on a fresh pool in `data_dir`; print a table; return the numbers."""
    config = config or PoolConfig()
    batch = [bench_step(i) for i in range(steps)]
    # The fixtures are tens of thousands of long-lived objects a real gateway would not hold;
    # without this, collecting them costs the callers 25-40 µs a step (as `clawr1 serve` does).
    gc.collect()
    gc.freeze()
    with SQLitePool(Path(data_dir), config) as pool:
        chunks = [batch[k::threads] for k in range(threads)]
        start, cpu = time.perf_counter(), time.process_time()
        with ThreadPoolExecutor(threads) as executor:
            futures = [f for chunk in executor.map(lambda c: [pool.submit_step(s) for s in c], chunks) for f in chunk]
            stored = sum(f.result() for f in futures)
        grouped, cpu = time.perf_counter() - start, time.process_time() - cpu
        assert stored == steps, f"stored {stored} of {steps}"

        # The same work split in two, one after the other: encoding in the caller, then the writer
        # alone (its commit capacity when the callers' encoding runs on other cores).
        extra = [bench_step(steps + i) for i in range(steps)]
        start = time.perf_counter()
        rows = [step_row(step) for step in extra]
        encode_us = (time.perf_counter() - start) / steps * 1e6
        start = time.perf_counter()
        for future in [pool._writer.submit(ops.insert_steps, row) for row in rows]:
            future.result()
        writer_only = steps / (time.perf_counter() - start)

        single = [bench_step(2 * steps + i) for i in range(200)]
        start = time.perf_counter()
        for step in single:
            pool.append_step(step)
        one_by_one = len(single) / (time.perf_counter() - start)

        # The reward stage's job, group-committed too: every sample READY.
        for future in [pool.submit_reward(Reward(step_id=s.step_id, score=1.0, source="bench")) for s in batch]:
            future.result()
        latencies = []
        for _ in range(max(1, min(100, steps // 64))):  # each lease takes 64 fresh READY samples
            start = time.perf_counter()
            lease = pool.lease(64)
            latencies.append((time.perf_counter() - start) * 1e3)
            assert len(lease) == 64
            pool.ack(lease)
    latencies.sort()
    result = {
        "steps": steps, "threads": threads, "synchronous": config.synchronous,
        "group_commit_steps_per_s": steps / grouped, "cpu_us_per_step": cpu / steps * 1e6,
        "encode_us_per_step": encode_us, "writer_only_steps_per_s": writer_only,
        "one_by_one_steps_per_s": one_by_one,
        "lease64_p50_ms": statistics.median(latencies),
        "lease64_p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
    }
    table = Table("measure", "value", "goal", title=f"Data pool ({steps:,} steps, synchronous={config.synchronous})")
    table.add_row(f"committed steps/s, group commit, {threads} callers", f"{steps / grouped:,.0f}", ">= 20,000")
    table.add_row("  CPU per step, all threads", f"{result['cpu_us_per_step']:.0f} µs", "")
    table.add_row("  encoding per step, in the caller", f"{encode_us:.0f} µs", "")
    table.add_row("  committed steps/s, writer alone", f"{writer_only:,.0f}", "")
    table.add_row("committed steps/s, one at a time", f"{one_by_one:,.0f}", "(reference)")
    table.add_row("lease(64) p50", f"{result['lease64_p50_ms']:.2f} ms", "<= 10 ms")
    table.add_row("lease(64) p99", f"{result['lease64_p99_ms']:.2f} ms", "")
    Console().print(table)
    return result
