"""Engine benchmark: our LocalEngine side by side with plain `transformers` generate, in one run.

All on the configured model, dtype, device and torch thread count, with 8 different chat prompts:

1. Throughput. Baseline: HF `model.generate` (greedy, exactly `max_tokens` new tokens) over the 8
   prompts one after another, which is what rollouts cost without a serving engine. Ours: the
   LocalEngine with 1 request, then 8 concurrent requests (continuous batching), counting the tokens
   actually generated (greedy may stop early at EOS). Agent rollouts arrive concurrently and one
   decode step is memory-bound, so a batch of 8 should cost little more than 1: goal engine@8 >= 3x.
2. Cost of logprob capture. The engine always records each sampled token's logprob (the trainer
   learns from them). We price that capture on the baseline, where it can be switched off: HF
   generate with `output_scores=True, return_dict_in_generate=True` plus a log_softmax/gather of the
   chosen tokens, against the same call without, paired per prompt. Goal <= 5%.
3. Adapter hot swap. A random LoRA (r=8, attention projections) is published as v1 and v2; we time
   `load_adapter` of v1 on an idle engine, the swap to v2 while 8 generations run on it (a new peft
   slot), and the steady-state swap to v3 (copied into the slot v1 left). New
   policy versions land mid-rollout, so the swap must be quick and no running request may fail.
4. A long prompt beside a stream. A 1,536-token prompt arrives while a request decodes; we time the
   stream's longest gap between two tokens and the long prompt's first token, with the prompt
   prefilled in one pass and in `engine.prefill_chunk` chunks (a decode step between two). Goal:
   chunking cuts the stall at least 2x for at most 10% more time to the long prompt's first token.
5. An agent's next turn. An agent resends its whole conversation each turn (OpenClaw's system prompt
   alone is ~2.7k tokens), so turn 2's prompt starts with turn 1's. We time turn 2's first token
   (a 2,048-token system prompt, a question, a reply, a follow-up) after turn 1 was served, so its
   prefix is in the engine's prefix cache, against the same-sized prompt of a conversation the engine
   has not seen (another system prompt: nothing to reuse). Goal: at least 5x sooner. Then turn 2
   resending the model's own 64-token reply to turn 1 (greedy), with the reply's KV kept in the
   cache beside its prompt's (ours) and without (the engine before it kept replies).
6. Decoding at an agent's context. Four conversations with 2,048-token system prompts decode
   together (greedy, the same tokens on both sides): the batch's cache appending in place (ours)
   against copying the whole cache every step, which is what transformers' `DynamicLayer` does
   (`engine.batch.HEADROOM = 0` reproduces it). Decode tokens/s once all four have their first
   token, each side twice in the order copied, grown, grown, copied, the mean of each; the prompts are prefilled once, before
   either side. Fewer tokens than the headroom (256) are decoded, so the grown side never pays
   its one copy per 256 steps. Goal: at least 1.15x.
7. An agent's next turn after a new version. A swap empties the replaced version's prefix cache, so
   with a new version every few minutes an agent's next turn is cold again. Turn 1 of a conversation
   (2,048-token system prompt) is served by the adapter, a new version is swapped in, and turn 2's
   first token is timed: with `engine.prefix_rewarm = 0` (cold), and with the engine's idle time
   between the swap and turn 2 spent re-prefilling turn 1 under the new version (as between an
   agent's turns; the time that takes is printed too). Goal: at least 5x sooner.

Phases 1-4 run with the prefix cache off (their prompts repeat, which the HF baseline cannot reuse).
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from clawr1.core.config import Config
from clawr1.core.types import Generation, SamplingParams
from clawr1.engine import adapters
from clawr1.engine.local import LocalEngine
from clawr1.engine.models import resolve_model

ADAPTER = "policy"
LONG_PROMPT = 1536  # tokens: 3 chunks of the default 512
AGENT_SYSTEM = 2048  # tokens of an agent's system prompt
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works, step by step.",
    "Give me a detailed plan for learning to play the guitar in three months.",
    "Describe the water cycle to a ten-year-old.",
    "What are the pros and cons of working from home? Answer at length.",
    "Write a poem about autumn leaves and the passing of time.",
    "Explain the difference between a list and a tuple in Python, with examples.",
    "Describe a walk through a busy market in a city you imagine.",
]


def run(config: Config, max_tokens: int = 64, console: Console | None = None) -> dict[str, Any]:
    """Run the benchmark, print a table of results and ratios, and return the numbers."""
    console = console or Console()
    numbers = asyncio.run(_bench(config, max_tokens, console))
    console.print(_table(numbers))
    return numbers


async def _bench(config: Config, max_tokens: int, console: Console) -> dict[str, Any]:
    path = resolve_model(config.engine.model, config.data_dir)
    with console.status(f"Loading {config.engine.model} twice (engine + HF baseline)..."):
        engine = LocalEngine.load(path, config.engine)  # sets torch's thread count from the config
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, config.engine.dtype))
        hf = hf.to(config.engine.device).eval()
    r: dict[str, Any] = {"max_tokens": max_tokens, "threads": torch.get_num_threads()}
    cache_mb = config.engine.prefix_cache_mb
    # Phases 1-4 without the prefix cache: their prompts repeat (a warm-up, the same 8 each time), which
    # the HF baseline could not reuse; the engine reads the setting live. Phase 5 measures the cache.
    engine.config = engine.config.model_copy(update={"prefix_cache_mb": 0})
    try:
        prompts = [engine.render([{"role": "user", "content": p}]) for p in PROMPTS]
        with console.status(f"HF generate: {len(prompts)} prompts sequentially, without and with logprobs..."):
            r.update(_hf_phase(hf, prompts, max_tokens, engine.tokenizer.eos_token_id))
        with console.status("Engine: 1 request, then 8 concurrent..."):
            r.update(await _engine_phase(engine, prompts, max_tokens))
        r["speedup_1"] = r["engine_1_tok_s"] / r["hf_1_tok_s"]
        r["speedup_8"] = r["engine_8_tok_s"] / r["hf_seq_tok_s"]
        with console.status(f"A {LONG_PROMPT}-token prompt beside a stream, in one pass and chunked..."):
            r.update(await _prefill_phase(engine, prompts))
        with console.status(f"An agent's second turn after a {AGENT_SYSTEM}-token system prompt, cached and cold..."):
            engine.config = engine.config.model_copy(update={"prefix_cache_mb": cache_mb or 512})
            r.update(await _next_turn_phase(engine))
            engine.config = engine.config.model_copy(update={"prefix_cache_mb": 0})
        with console.status(f"Decoding 4 conversations at {AGENT_SYSTEM}-token contexts, cache copied and grown..."):
            engine.config = engine.config.model_copy(update={"prefix_cache_mb": cache_mb or 512})
            r.update(await _long_decode_phase(engine, max_tokens))
            engine.config = engine.config.model_copy(update={"prefix_cache_mb": 0})
        with console.status("Adapters: load v1, then swap to v2 under 8 running requests..."):
            r.update(await _adapter_phase(engine, hf, prompts, max_tokens, cache_mb or 512))
    finally:
        await engine.close()
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}


def _hf_generate(model: Any, prompt: list[int], max_tokens: int, pad: int, capture: bool) -> tuple[int, float]:
    """One greedy HF generate of exactly `max_tokens` tokens; (tokens, seconds).

    With `capture`, also returns every step's scores and turns them into the chosen tokens'
    logprobs (log_softmax + gather, moved to Python floats like the engine's), all inside the timing.
    """
    ids = torch.tensor([prompt], device=model.device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                         min_new_tokens=max_tokens, pad_token_id=pad,
                         output_scores=capture, return_dict_in_generate=capture)
    sequences = out.sequences if capture else out
    new = sequences[:, ids.shape[1]:]
    if capture:
        logp = torch.log_softmax(torch.stack(out.scores, dim=1).float(), dim=-1)
        logp.gather(-1, new[..., None]).squeeze(-1).tolist()
    return new.shape[1], time.perf_counter() - start


def _hf_phase(hf: Any, prompts: list[list[int]], max_tokens: int, pad: int) -> dict[str, Any]:
    for capture in (False, True):  # warm-up: first calls pay one-off allocation costs
        _hf_generate(hf, prompts[0], 4, pad, capture)
    plain, captured = [], []
    for i, prompt in enumerate(prompts):
        # Alternate which variant runs first so drift (heat, other processes) cancels out.
        for capture in ((False, True) if i % 2 == 0 else (True, False)):
            (captured if capture else plain).append(_hf_generate(hf, prompt, max_tokens, pad, capture))
    tokens, seconds = sum(n for n, _ in plain), sum(s for _, s in plain)
    # Overhead = median over prompts of (time with capture / time without) - 1: a burst of load from
    # another process spoils one pair, not the result.
    ratios = [c[1] / p[1] for c, p in zip(captured, plain)]
    return {
        "hf_1_tok_s": plain[0][0] / plain[0][1],
        "hf_seq_tok_s": tokens / seconds,
        "hf_seq_tokens": tokens,
        "logprob_overhead_pct": 100 * (statistics.median(ratios) - 1),
    }


async def _timed(engine: LocalEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[Generation], float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    start = time.perf_counter()
    gens = await asyncio.gather(*(engine.generate(p, params).final() for p in prompts))
    return list(gens), time.perf_counter() - start


async def _engine_phase(engine: LocalEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    await _timed(engine, prompts[:1], 4)  # warm-up
    one, one_s = await _timed(engine, prompts[:1], max_tokens)
    steps, decoded = engine.stats["decode_steps"], engine.stats["decode_tokens"]
    many, many_s = await _timed(engine, prompts, max_tokens)
    steps, decoded = engine.stats["decode_steps"] - steps, engine.stats["decode_tokens"] - decoded
    tokens = sum(len(g.token_ids) for g in many)
    return {
        "engine_1_tok_s": len(one[0].token_ids) / one_s,
        "engine_8_tok_s": tokens / many_s,
        "engine_8_tokens": tokens,
        "engine_8_mean_batch": decoded / max(steps, 1),
    }


async def _follow(stream: Any, times: list[float]) -> None:
    """Note when each token of `stream` arrives, and when it ends."""
    async for _ in stream:
        times.append(time.perf_counter())
    times.append(time.perf_counter())


def _rotated(shift: int, tokens: int, engine: LocalEngine) -> str:
    """`tokens` tokens of text, a different text for each `shift` (so no prompt reuses another's prefix):
    the prompts rotated by `shift`, in reverse order from `shift` 8 on."""
    turn = shift % len(PROMPTS)
    order = PROMPTS[turn:] + PROMPTS[:turn]
    ids = engine.tokenizer(" ".join(order if shift < len(PROMPTS) else order[::-1]) * 40)["input_ids"][:tokens]
    return engine.tokenizer.decode(ids)


async def _prefill_phase(engine: LocalEngine, prompts: list[list[int]]) -> dict[str, Any]:
    long_prompt = engine.render([{"role": "user", "content": " ".join(PROMPTS * 40)}])[:LONG_PROMPT]
    chunk = engine.config.prefill_chunk
    r: dict[str, Any] = {"long_prompt_tokens": len(long_prompt), "prefill_chunk": chunk}
    for name, size in (("one_pass", len(long_prompt)), ("chunked", chunk)):  # the prefix cache is off here
        engine.config = engine.config.model_copy(update={"prefill_chunk": size})
        stream = engine.generate(prompts[0], SamplingParams(max_tokens=2048, temperature=1.0, seed=0))
        times: list[float] = []
        following = asyncio.create_task(_follow(stream, times))
        while len(times) < 4:  # decoding
            if following.done():
                raise RuntimeError("the background stream ended before the long prompt came: rerun")
            await asyncio.sleep(0.005)
        start = time.perf_counter()
        late = engine.generate(long_prompt, SamplingParams(max_tokens=1, temperature=0))
        await anext(aiter(late))
        first = time.perf_counter()
        await late.final()
        await asyncio.sleep(0.5)  # a few tokens after it, so the stall's end is seen
        stream.cancel()
        await following
        if not any(t > first for t in times[:-1]):  # the last time is its end, not a token
            raise RuntimeError("the background stream ended during the long prefill: its gap is not the stall")
        window = [t for t in times if t >= start - 1.0]
        r[f"prefill_{name}_ttft_s"] = first - start
        r[f"prefill_{name}_stall_s"] = max(b - a for a, b in itertools.pairwise(window))
    engine.config = engine.config.model_copy(update={"prefill_chunk": chunk})
    r["prefill_stall_ratio"] = r["prefill_one_pass_stall_s"] / r["prefill_chunked_stall_s"]
    r["prefill_ttft_ratio"] = r["prefill_chunked_ttft_s"] / r["prefill_one_pass_ttft_s"]
    return r


async def _next_turn_phase(engine: LocalEngine) -> dict[str, Any]:
    greedy = SamplingParams(max_tokens=1, temperature=0)
    r: dict[str, Any] = {"agent_system_tokens": AGENT_SYSTEM}
    for name, shift in (("cold", 4), ("cached", 5)):
        first = [{"role": "system", "content": _rotated(shift, AGENT_SYSTEM, engine)},
                 {"role": "user", "content": PROMPTS[1]}]
        second = first + [{"role": "assistant", "content": "A refrigerator pumps heat out of its box."},
                          {"role": "user", "content": "And why does the back of it feel warm?"}]
        if name == "cached":
            await engine.generate(engine.render(first), greedy).final()  # turn 1, served before
        r.update(await _first_token(engine, second, f"turn2_{name}"))
    r["turn2_speedup"] = r["turn2_cold_ttft_s"] / r["turn2_cached_ttft_s"]
    # Turn 2 resending the model's own 64-token reply: its KV kept with the prompt's, or not.
    for name, shift, kept in (("reply_dropped", 8, False), ("reply_kept", 9, True)):
        if not kept:
            engine._keep_reply = lambda row, request: None  # what the engine did before replies were kept
        try:
            first = [{"role": "system", "content": _rotated(shift, AGENT_SYSTEM, engine)},
                     {"role": "user", "content": PROMPTS[6]}]
            reply = await engine.generate(engine.render(first), SamplingParams(max_tokens=64, temperature=0)).final()
        finally:  # on the scheduler thread: it answers a request before it files the reply
            await engine._call(lambda: engine.__dict__.pop("_keep_reply", None))
        second = first + [{"role": "assistant", "content": reply.text},
                          {"role": "user", "content": "Show me one more example."}]
        r.update(await _first_token(engine, second, f"turn2_{name}"))
        r[f"turn2_{name}_reply_tokens"] = len(reply.token_ids)
    r["turn2_reply_speedup"] = r["turn2_reply_dropped_ttft_s"] / r["turn2_reply_kept_ttft_s"]
    return r


async def _first_token(engine: LocalEngine, messages: list[dict[str, str]], name: str,
                       adapter: str | None = None) -> dict[str, Any]:
    """Time to the first token of `messages` (greedy), with how many of its tokens were prefilled."""
    prompt, prefilled = engine.render(messages), engine.stats["prefill_tokens"]
    start = time.perf_counter()
    await engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0), adapter).final()
    return {f"{name}_ttft_s": time.perf_counter() - start,
            f"{name}_prefilled": engine.stats["prefill_tokens"] - prefilled, f"{name}_tokens": len(prompt)}


async def _long_decode_phase(engine: LocalEngine, max_tokens: int) -> dict[str, Any]:
    from clawr1.engine import batch

    prompts = [engine.render([{"role": "system", "content": _rotated(shift, AGENT_SYSTEM, engine)},
                              {"role": "user", "content": PROMPTS[shift]}]) for shift in range(4)]
    for prompt in prompts:  # prefilled once, into the prefix cache: both sides start from it
        await engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0)).final()
    r: dict[str, Any] = {"long_decode_context": min(len(p) for p in prompts)}
    rates: dict[str, list[float]] = {"copied": [], "grown": []}
    headroom = batch.HEADROOM
    try:
        for name, room in (("copied", 0), ("grown", headroom), ("grown", headroom), ("copied", 0)):  # ABBA order
            batch.HEADROOM = room
            streams = [engine.generate(p, SamplingParams(max_tokens=max_tokens, temperature=0)) for p in prompts]
            times: list[list[float]] = [[] for _ in prompts]
            await asyncio.gather(*(_follow(s, t) for s, t in zip(streams, times)))
            start = max(t[0] for t in times)  # every row in the batch from here on (until one ends)
            end = max(t[-2] for t in times)  # each list ends with the stream's end, after its last token
            tokens = sum(sum(1 for x in t[:-1] if x > start) for t in times)
            rates[name].append(tokens / (end - start))
    finally:
        batch.HEADROOM = headroom
    for name, measured in rates.items():
        r[f"long_decode_{name}_tok_s"] = statistics.mean(measured)
    r["long_decode_speedup"] = r["long_decode_grown_tok_s"] / r["long_decode_copied_tok_s"]
    return r


async def _adapter_phase(engine: LocalEngine, hf: Any, prompts: list[list[int]], max_tokens: int,
                         cache_mb: int) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model

    # The HF copy is done with; it becomes the trainer's side that publishes adapters.
    lora = LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)
    trainer = get_peft_model(hf, lora, adapter_name=ADAPTER)
    with tempfile.TemporaryDirectory(prefix="clawr1-bench-") as root:
        v1 = adapters.publish(trainer, Path(root), ADAPTER, 1)
        _scale_lora_b(trainer, -1.0)  # different weights, as after a training step
        v2 = adapters.publish(trainer, Path(root), ADAPTER, 2)
        _scale_lora_b(trainer, 0.5)
        v3 = adapters.publish(trainer, Path(root), ADAPTER, 3)

        start = time.perf_counter()
        await engine.load_adapter(ADAPTER, v1)
        first_ms = 1000 * (time.perf_counter() - start)

        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        started = [asyncio.Event() for _ in prompts]

        async def request(prompt: list[int], event: asyncio.Event) -> Generation:
            stream = engine.generate(prompt, params, ADAPTER)
            try:
                async for _ in stream:
                    event.set()  # this request is decoding
            finally:
                event.set()
            assert stream.generation is not None
            return stream.generation

        tasks = [asyncio.create_task(request(p, e)) for p, e in zip(prompts, started)]
        await asyncio.gather(*(e.wait() for e in started))
        running = sum(not t.done() for t in tasks)
        start = time.perf_counter()
        await engine.load_adapter(ADAPTER, v2)
        swap_ms = 1000 * (time.perf_counter() - start)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        after = await engine.generate(prompts[0], SamplingParams(max_tokens=4, temperature=0), ADAPTER).final()
        # Steady state: v1's slot is free again, so v3 is copied into it instead of injected.
        start = time.perf_counter()
        await engine.load_adapter(ADAPTER, v3)
        steady_ms = 1000 * (time.perf_counter() - start)
        engine.config = engine.config.model_copy(update={"prefix_cache_mb": cache_mb})
        try:
            swapped_turn = await _swapped_turn_phase(engine, trainer, Path(root))
        finally:
            engine.config = engine.config.model_copy(update={"prefix_cache_mb": 0})

    gens = [g for g in results if isinstance(g, Generation)]
    failed = len(results) - len(gens) + sum(g.finish_reason not in ("stop", "length") for g in gens)
    return swapped_turn | {
        "swap_ms_first": first_ms,
        "swap_ms_under_load": swap_ms,
        "swap_ms_steady": steady_ms,
        "swap_running_requests": running,  # decoding when the swap was requested
        "failed_requests": failed,
        "running_kept_v1": all(g.version == 1 for g in gens),  # submitted before the swap: pinned to v1
        "new_request_version": after.version,  # submitted after: must get v2
    }


async def _swapped_turn_phase(engine: LocalEngine, trainer: Any, root: Path) -> dict[str, Any]:
    """Phase 7: turn 2 after a swap, cold (`prefix_rewarm = 0`) and re-warmed while idle."""
    greedy = SamplingParams(max_tokens=1, temperature=0)
    configured = engine.config.prefix_rewarm
    r: dict[str, Any] = {}
    try:
        # Re-warmed: 1 prompt, turn 1 (the replaced version's most recent; the cold side's turn 2 is older).
        for version, (name, n), shift in ((4, ("cold", 0), 6), (5, ("rewarmed", 1), 7)):
            engine.config = engine.config.model_copy(update={"prefix_rewarm": n})
            first = [{"role": "system", "content": _rotated(shift, AGENT_SYSTEM, engine)},
                     {"role": "user", "content": PROMPTS[2]}]
            second = first + [{"role": "assistant", "content": "Practise chords for twenty minutes a day."},
                              {"role": "user", "content": "Which chords should I learn first?"}]
            await engine.generate(engine.render(first), greedy, ADAPTER).final()  # turn 1, the version before
            _scale_lora_b(trainer, 0.9)  # a training step's worth of change
            path = await asyncio.to_thread(adapters.publish, trainer, root, ADAPTER, version)
            start = time.perf_counter()
            await engine.load_adapter(ADAPTER, path)
            while engine.rewarming:  # the idle time an agent's user gives it (none is needed when cold)
                await asyncio.sleep(0.01)
            r[f"swapped_turn2_{name}_idle_s"] = time.perf_counter() - start
            r.update(await _first_token(engine, second, f"swapped_turn2_{name}", ADAPTER))
    finally:
        engine.config = engine.config.model_copy(update={"prefix_rewarm": configured})
    r["swapped_turn2_speedup"] = r["swapped_turn2_cold_ttft_s"] / r["swapped_turn2_rewarmed_ttft_s"]
    return r


def _scale_lora_b(model: Any, factor: float) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(factor)


def _table(r: dict[str, Any]) -> Table:
    table = Table(title=f"Engine benchmark: {r['max_tokens']} new tokens/request, {r['threads']} torch threads")
    table.add_column("measurement")
    table.add_column("value", justify="right")
    table.add_column("ratio / goal", justify="right")
    base = r["hf_seq_tok_s"]
    table.add_row("HF generate, 1 prompt", f"{r['hf_1_tok_s']:.1f} tok/s", f"{r['hf_1_tok_s'] / base:.2f}x")
    table.add_row("HF generate, 8 prompts sequential", f"{base:.1f} tok/s", "1.00x (baseline)")
    table.add_row("engine, 1 request", f"{r['engine_1_tok_s']:.1f} tok/s", f"{r['speedup_1']:.2f}x vs HF 1 prompt")
    table.add_row(f"engine, 8 concurrent ({r['engine_8_tokens']} tok, mean batch {r['engine_8_mean_batch']:.1f})",
                  f"{r['engine_8_tok_s']:.1f} tok/s", _goal(f"{r['speedup_8']:.2f}x", r["speedup_8"] >= 3, ">= 3x"))
    overhead = r["logprob_overhead_pct"]
    table.add_row("logprob capture overhead (HF, scores + log_softmax)", f"{overhead:+.1f}%",
                  _goal("", overhead <= 5, "<= 5%"))
    table.add_row(f"stream's longest token gap, {r['long_prompt_tokens']}-token prompt in one pass",
                  f"{r['prefill_one_pass_stall_s']:.2f} s", "1.00x (baseline)")
    table.add_row(f"  ... prefilled in {r['prefill_chunk']}-token chunks", f"{r['prefill_chunked_stall_s']:.2f} s",
                  _goal(f"{r['prefill_stall_ratio']:.1f}x shorter", r["prefill_stall_ratio"] >= 2, ">= 2x"))
    table.add_row("long prompt's first token, one pass / chunked",
                  f"{r['prefill_one_pass_ttft_s']:.2f} / {r['prefill_chunked_ttft_s']:.2f} s",
                  _goal(f"{r['prefill_ttft_ratio']:.2f}x", r["prefill_ttft_ratio"] <= 1.1, "<= 1.10x"))
    table.add_row(f"agent's turn 2 ({r['turn2_cold_tokens']} tokens), first token, nothing cached "
                  f"({r['turn2_cold_prefilled']} prefilled)", f"{r['turn2_cold_ttft_s']:.2f} s", "1.00x (baseline)")
    table.add_row(f"  ... turn 1's prefix cached ({r['turn2_cached_tokens']} tokens, "
                  f"{r['turn2_cached_prefilled']} prefilled)",
                  f"{r['turn2_cached_ttft_s']:.2f} s",
                  _goal(f"{r['turn2_speedup']:.1f}x sooner", r["turn2_speedup"] >= 5, ">= 5x"))
    table.add_row(f"agent's turn 2 ({r['turn2_reply_dropped_tokens']} tokens) resending the model's "
                  f"{r['turn2_reply_dropped_reply_tokens']}-token reply, prompt cached, reply not "
                  f"({r['turn2_reply_dropped_prefilled']} prefilled)", f"{r['turn2_reply_dropped_ttft_s']:.2f} s",
                  "1.00x (baseline)")
    table.add_row(f"  ... the reply's KV kept with the prompt's ({r['turn2_reply_kept_prefilled']} prefilled)",
                  f"{r['turn2_reply_kept_ttft_s']:.2f} s", f"{r['turn2_reply_speedup']:.1f}x sooner")
    table.add_row(f"decode, 4 conversations at {r['long_decode_context']}+ tokens, cache copied every step",
                  f"{r['long_decode_copied_tok_s']:.1f} tok/s", "1.00x (baseline)")
    table.add_row("  ... cache grown in place", f"{r['long_decode_grown_tok_s']:.1f} tok/s",
                  _goal(f"{r['long_decode_speedup']:.2f}x", r["long_decode_speedup"] >= 1.15, ">= 1.15x"))
    table.add_row(f"agent's turn 2 ({r['swapped_turn2_cold_tokens']} tokens) right after a swap, first token, "
                  f"cold ({r['swapped_turn2_cold_prefilled']} prefilled)",
                  f"{r['swapped_turn2_cold_ttft_s']:.2f} s", "1.00x (baseline)")
    table.add_row(f"  ... turn 1 re-warmed under the new version while idle ({r['swapped_turn2_rewarmed_idle_s']:.1f} s "
                  f"of idle time; {r['swapped_turn2_rewarmed_prefilled']} prefilled)",
                  f"{r['swapped_turn2_rewarmed_ttft_s']:.2f} s",
                  _goal(f"{r['swapped_turn2_speedup']:.1f}x sooner", r["swapped_turn2_speedup"] >= 5, ">= 5x"))
    table.add_row("adapter load v1, idle engine", f"{r['swap_ms_first']:.0f} ms", "")
    table.add_row(f"adapter swap to v2, {r['swap_running_requests']} requests running",
                  f"{r['swap_ms_under_load']:.0f} ms", "")
    table.add_row("adapter swap v2 -> v3, spare slot reused (steady state)", f"{r['swap_ms_steady']:.0f} ms", "")
    ok = r["failed_requests"] == 0 and r["running_kept_v1"] and r["new_request_version"] == 2
    table.add_row("failed requests / running kept v1 / new gets v2",
                  f"{r['failed_requests']} / {r['running_kept_v1']} / v{r['new_request_version']}",
                  _goal("", ok, "0 / True / v2"))
    return table


def _goal(text: str, met: bool, goal: str) -> str:
    mark = "[green]met[/green]" if met else "[red]missed[/red]"
    return f"{text} {mark} (goal {goal})".strip()
