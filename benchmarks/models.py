"""The embedded models side by side, in one run: what choosing one costs a user of `clawr1 up` on
this machine (the default is decided from these numbers: README, "Which model").

For each embedded model, at the engine's and the trainer's configured thread counts, sampling at
the model's own recommended settings:
1. One user: seconds to the first token of a reply (a system prompt and a question, ~60 tokens)
   and to a 100-token reply (the first token, then 99 at the measured decode rate: a reply that
   stops early still prices 100).
2. Four users at once (continuous batching): the same, each request's own, averaged.
3. A version's cost: one trainer step (`trainer.batch_size` samples of the engine's own replies,
   the product's defaults: LoRA, `combine`) and the guard's probes (`guard.probes` replies of at most
   `guard.probe_max_tokens` tokens, as the guard asks them), and from their sum the most versions
   an hour can bring when samples are always waiting.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from clawr1.core.config import Config, EngineConfig, load_config
from clawr1.core.records import Reward, Step
from clawr1.core.types import SamplingParams
from clawr1.engine.local import LocalEngine
from clawr1.engine.models import EMBEDDED, resolve_model

SYSTEM = "You are a helpful assistant. Answer the user's questions clearly."
QUESTIONS = ["How do I keep basil fresh after buying it?", "What is a good way to start journaling?",
             "How can I make my small apartment feel bigger?", "What should I check before buying a used bike?"]


async def _timed(engine: LocalEngine, prompt: list[int], sampling: SamplingParams) -> tuple[float, float, Any]:
    """(seconds to the first token, decode seconds a token after it, the generation)."""
    started = time.perf_counter()
    stream = engine.generate(prompt, sampling)
    first = None
    async for _ in stream:
        if first is None:
            first = time.perf_counter() - started
    gen = await stream.final()
    total = time.perf_counter() - started
    tokens = len(gen.token_ids)
    return first or total, (total - (first or total)) / max(tokens - 1, 1), gen


async def _serve(engine: LocalEngine, users: int, seed: int) -> tuple[float, float, list[Any]]:
    d = engine.sampling_defaults
    prompts = [engine.render([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
               for q in QUESTIONS[:users]]
    runs = await asyncio.gather(*[_timed(engine, p, SamplingParams(max_tokens=100, temperature=d.temperature,
                                                                   top_p=d.top_p, top_k=d.top_k, seed=seed + i))
                                  for i, p in enumerate(prompts)])
    ttft = statistics.mean(r[0] for r in runs)
    return ttft, statistics.mean(r[0] + 99 * r[1] for r in runs), [r[2] for r in runs]


def _version_cost(config: Config, model: Path, gens: list[Any], messages: list[list[dict]], engine: LocalEngine,
                  ) -> tuple[float, float]:
    """(a trainer step's seconds, the guard's probes' seconds) at the product's defaults."""
    from clawr1.datapool import SQLitePool
    from clawr1.trainer.loop import Trainer

    with tempfile.TemporaryDirectory(prefix="clawr1-bench-models-") as tmp:
        cfg = load_config(None, [f'data_dir="{tmp}"', f'engine.model="{model}"', "trainer.max_wait_s=0",
                                 "guard.enabled=false", f"trainer.threads={config.trainer.threads}"])
        n = cfg.trainer.batch_size
        with SQLitePool(Path(tmp), cfg.pool) as pool:
            for i in range(n):
                gen, m = gens[i % len(gens)], messages[i % len(messages)]
                pool.append_step(Step(step_id=f"b-{i}", tenant="default", session_id=f"s{i}", prompt_id=f"s{i}",
                                      turn_index=0, turn_type="main", messages=m, tools=None,
                                      prompt_ids=gen.prompt_ids, token_ids=gen.token_ids, logprobs=gen.logprobs,
                                      text=gen.text, policy_version=0, adapter=None, finish_reason=gen.finish_reason,
                                      temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k))
                pool.add_reward(Reward(step_id=f"b-{i}", score=1.0 if i % 2 else -1.0, source="bench"))
            trainer = Trainer(cfg, pool, resume=False)
            started = time.perf_counter()
            trainer.run_once()
            step = time.perf_counter() - started
    d, guard = engine.sampling_defaults, config.guard
    probes = [engine.render([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]) for i in range(guard.probes)]

    async def ask() -> float:
        started = time.perf_counter()
        await asyncio.gather(*[engine.generate(p, SamplingParams(max_tokens=guard.probe_max_tokens, seed=i,
                                                                 temperature=d.temperature, top_p=d.top_p,
                                                                 top_k=d.top_k)).final()
                               for i, p in enumerate(probes)])
        return time.perf_counter() - started

    return step, asyncio.run(ask())


def run(config: Config, console: Console) -> dict[str, Any]:
    numbers: dict[str, Any] = {}
    for name in EMBEDDED:
        console.print(f"[bold]{name}[/bold]: loading ...")
        path = resolve_model(name, config.data_dir)
        engine = LocalEngine.load(path, EngineConfig(threads=config.engine.threads, max_batch=config.engine.max_batch))
        try:
            asyncio.run(_serve(engine, 1, 0))  # warm-up
            one = asyncio.run(_serve(engine, 1, 1))
            four = asyncio.run(_serve(engine, 4, 2))
            messages = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
            console.print(f"[bold]{name}[/bold]: a trainer step of {config.trainer.batch_size} samples and "
                          f"{config.guard.probes} probes ...")
            step, probes = _version_cost(config, path, four[2], messages, engine)
        finally:
            asyncio.run(engine.close())
        numbers[name] = {"ttft_1": one[0], "reply100_1": one[1], "ttft_4": four[0], "reply100_4": four[1],
                         "train_step_s": step, "probes_s": probes, "versions_per_hour": 3600 / (step + probes),
                         "reply": four[2][0].text[:200]}
    table = Table("model", "first token, 1 user", "100 tokens, 1 user", "first token, 4 users",
                  "100 tokens, 4 users", "trainer step", "guard probes", "versions/hour (most)",
                  title=f"Embedded models (engine {config.engine.threads} thread(s), trainer "
                        f"{config.trainer.threads}; batch {config.trainer.batch_size})")
    for name, n in numbers.items():
        table.add_row(name, f"{n['ttft_1']:.2f} s", f"{n['reply100_1']:.1f} s", f"{n['ttft_4']:.2f} s",
                      f"{n['reply100_4']:.1f} s", f"{n['train_step_s']:.0f} s", f"{n['probes_s']:.0f} s",
                      f"{n['versions_per_hour']:.0f}")
    console.print(table)
    for name, n in numbers.items():
        console.print(f"{name}, a reply: {n['reply']!r}")
    return numbers
