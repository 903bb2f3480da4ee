"""Pool benchmark: committed steps/s with group commit, and the latency of leasing 64 samples.

1. Throughput. 20,000 realistic steps (4-message history, 128 sampled tokens with logprobs, 1,000
   sessions of 20 main turns, so next-state linking runs too) are submitted from 8 threads at
   once, as concurrent gateway requests would, and the clock stops when the last future resolves,
   i.e. when the last step is committed under the configured `synchronous` (FULL: fsynced).
   Goal >= 20k steps/s. For reference, the same steps appended one at a time (one transaction
   and one fsync each) on a slice of them.
2. Lease latency. All steps are rewarded (READY); a trainer-style loop leases 64 and acks, 100
   times; p50/p99 of `lease(64)`. Goal <= 10 ms.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from clawr1.core.config import PoolConfig
from clawr1.core.records import Reward, Step
from clawr1.datapool.sqlite import SQLitePool


def _step(i: int, turns: int = 20, tokens: int = 128) -> Step:
    session, turn = divmod(i, turns)
    history = [{"role": "system", "content": "You are a helpful coding agent."},
               {"role": "user", "content": f"Fix the failing test in module {session}, please."},
               {"role": "assistant", "content": "I will run the tests first."},
               {"role": "tool", "tool_call_id": f"call_{turn}", "content": "FAILED test_parse - AssertionError"}]
    return Step(step_id=f"bench-{i}", tenant="default", session_id=f"s{session}", prompt_id=f"p{session}",
                turn_index=turn, turn_type="main", messages=history, tools=None,
                prompt_ids=list(range(200)), token_ids=[(i + k) % 49_152 for k in range(tokens)],
                logprobs=[-0.25 - k * 1e-3 for k in range(tokens)], text="The parser drops the last field. " * 4,
                policy_version=0, adapter=None, finish_reason="stop", temperature=1.0, timings={"ttft_ms": 12.5})


def bench_pool(data_dir: Path, steps: int = 20_000, threads: int = 8, config: PoolConfig | None = None) -> dict[str, Any]:
    """Run both measurements on a fresh pool in `data_dir`; print a table; return the numbers."""
    config = config or PoolConfig()
    batch = [_step(i) for i in range(steps)]
    with SQLitePool(Path(data_dir), config) as pool:
        chunks = [batch[k::threads] for k in range(threads)]
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as executor:
            futures = [f for chunk in executor.map(lambda c: [pool.submit_step(s) for s in c], chunks) for f in chunk]
            stored = sum(f.result() for f in futures)
        grouped = time.perf_counter() - start
        assert stored == steps, f"stored {stored} of {steps}"

        single = [_step(steps + i) for i in range(200)]
        start = time.perf_counter()
        for step in single:
            pool.append_step(step)
        one_by_one = len(single) / (time.perf_counter() - start)

        # The reward stage's job, group-committed too: every sample READY.
        for future in [pool.submit_reward(Reward(step_id=s.step_id, score=1.0, source="bench")) for s in batch]:
            future.result()
        latencies = []
        for _ in range(100):
            start = time.perf_counter()
            lease = pool.lease(64)
            latencies.append((time.perf_counter() - start) * 1e3)
            assert len(lease) == 64
            pool.ack(lease)
    latencies.sort()
    result = {
        "steps": steps, "synchronous": config.synchronous,
        "group_commit_steps_per_s": steps / grouped, "one_by_one_steps_per_s": one_by_one,
        "lease64_p50_ms": statistics.median(latencies), "lease64_p99_ms": latencies[98],
    }
    table = Table("measure", "value", "goal", title=f"Data pool ({steps:,} steps, synchronous={config.synchronous})")
    table.add_row("committed steps/s, group commit", f"{result['group_commit_steps_per_s']:,.0f}", ">= 20,000")
    table.add_row("committed steps/s, one at a time", f"{one_by_one:,.0f}", "(reference)")
    table.add_row("lease(64) p50", f"{result['lease64_p50_ms']:.2f} ms", "<= 10 ms")
    table.add_row("lease(64) p99", f"{result['lease64_p99_ms']:.2f} ms", "")
    Console().print(table)
    return result

