"""Trainer benchmark: our LoRA train step next to TRL's GRPOTrainer train step, in one run.

Both sides train the same LoRA (rank, alpha, target modules, no dropout) on the same model, fp32 on
the CPU with the same torch thread count, over the same batch: `samples` chat prompts, each with a
reply of exactly `reply_tokens` tokens (seeded random vocabulary ids: a step's cost does not depend
on which tokens they are), alternating +1/-1 advantages, and behaviour logprobs from a no-grad
forward pass, so every importance ratio starts at 1. No KL on either side: TRL at `beta = 0`, ours
at `kl_coef = 0` with `kl_base_every = 0` (no base-model forward for the drift metric either).

- TRL: an isolated GRPO train step: `GRPOTrainer.training_step` (its fused LM head forward, the
  clipped loss, backward) on a prepared batch of completions, then the Trainer loop's own grad clip,
  optimizer and scheduler step, after the setup `Trainer.train()` does (optimizer, scheduler,
  `accelerator.prepare`, and gradient checkpointing, which only `train()` switches on). Generation
  is bypassed (`_prepare_inputs` returns the batch as is), so only training is timed. Without
  checkpointing by default (our step does not recompute); `trl_checkpointing` adds TRL at its own
  default, checkpointing on. TRL lives in its own venv: `$CLAWR1_TRL_PYTHON` names its python.
- Ours: `Trainer.train_step` (micro-batches, logits only for reply tokens) at several micro-batch
  sizes, on a real (empty) pool in a temporary data dir.

`device`/`dtype` (`--device cuda --dtype bfloat16`) run both sides there (peak memory is then
`torch.cuda.max_memory_allocated`); `shape` (`--shape qwen2.5-1.5b`) builds a randomly initialised
model of a real architecture from its config alone (`SHAPES`: no weights are downloaded; the
embedded tokenizer's ids are valid in every one of their vocabularies), so GPU figures can be taken
on a machine that reaches no model hub.

Each side and setting runs in its own subprocess, so peak memory is that process's alone: the
kernel's peak-RSS mark (VmHWM) is reset after the warm-up step and read after the timed steps, so it
covers training, not model loading. Reported: the median wall time of the timed steps, trained reply
tokens per second, tokens per CPU-second (all threads' CPU time), and that peak. Goal: some
micro-batch setting of ours reaches >= 1.5x TRL's tokens/s at <= half its peak memory. On a busy
machine wall times mean little; run with `threads=1` and compare tokens per CPU-second.

This file also runs as a script (the subprocess entry point) under either venv, so its top level
imports only the standard library.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from clawr1.core.config import Config

TRL_ENV = "CLAWR1_TRL_PYTHON"
TRL_MISSING = (f"TRL not found: install it in its own venv and point ${TRL_ENV} at its python, e.g.\n"
               "  python3 -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install torch trl peft\n"
               f"  export {TRL_ENV}=/tmp/trl-venv/bin/python")
GOAL_SPEEDUP, GOAL_MEMORY = 1.5, 0.5  # ours/TRL tokens/s at least, ours/TRL peak memory at most
# Architectures by their published configs (config.json of each model card); random weights.
SHAPES: dict[str, dict[str, Any]] = {
    # Two layers of width 64 with SmolLM2's vocabulary: the GPU check's CPU dry run (QUICK=1).
    "tiny": {"model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 2048, "tie_word_embeddings": True},
    "smollm2-135m": {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": True},
    "qwen2.5-0.5b": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                     "tie_word_embeddings": True},
    "qwen2.5-1.5b": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
                     "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                     "tie_word_embeddings": True},
    "llama-3.1-8b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": False},
}
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


# ---- the parent: build one batch, run each side in a subprocess, print the table -------------------

def run(config: Config, console: Console | None = None, *, micro_batches: tuple[int, ...] = (8, 4, 2),
        samples: int = 8, reply_tokens: int = 256, threads: int = 2, steps: int = 3, warmup: int = 1,
        rounds: int = 1, trl_python: str | None = None, trl_checkpointing: bool = False,
        timeout_s: float = 1800.0, device: str = "cpu", dtype: str = "float32", shape: str | None = None,
        grad_checkpointing: bool = False, nproc: int = 1, finetune: str = "lora",
        quantize: str = "none") -> dict[str, Any]:
    """Run the benchmark, print a table of results and ratios, and return the numbers.

    `rounds` > 1 runs every setting that many times, round-robin, and keeps each one's fastest run:
    other work on the machine only ever adds time, so the minimum is the least disturbed estimate.

    `trl_checkpointing`: also measure TRL at its default `gradient_checkpointing=True`; the goal is
    checked against TRL without it (ours runs without it unless `grad_checkpointing`).

    `nproc` > 1 also runs each of our settings as that many data-parallel ranks (`ours_mbM_xN`:
    `torch.distributed`, gloo on the CPU, NCCL on CUDA, `threads // nproc` threads each on the CPU),
    beside the one-process run of the same setting; their peak is rank 0's. `finetune = "full"`
    trains every weight (FSDP2-sharded layers over the ranks) and measures ours only: the TRL side
    is a LoRA step. `quantize` ("4bit", "8bit") also runs each of our settings on quantized base
    weights (`ours_mbM_4bit`), beside the same step unquantized; it needs real weights (no `shape`).
    """
    from rich.console import Console

    from clawr1.engine.models import resolve_model

    console = console or Console()
    model = resolve_model(config.engine.model, config.data_dir)
    batch = make_batch(model, samples, reply_tokens)
    tc = config.trainer
    if shape is not None and shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")
    if quantize != "none" and shape is not None:
        raise ValueError("quantize needs the model's own weights (bitsandbytes quantizes them as they load): "
                         "drop the shape")
    base = {"model": str(model), "threads": threads, "steps": steps, "warmup": warmup, **batch,
            "device": device, "dtype": dtype, "shape": SHAPES.get(shape or ""), "grad_checkpointing": grad_checkpointing,
            "finetune": finetune, "nproc": 1,
            "lora": {"r": tc.lora_rank, "alpha": tc.lora_alpha, "targets": list(tc.lora_targets)},
            "lr": tc.lr, "grad_clip": tc.grad_clip, "eps_low": tc.eps_low, "eps_high": tc.eps_high}
    tokens = samples * reply_tokens
    out: dict[str, Any] = {"model": shape or config.engine.model, "random_weights": shape is not None,
                           "device": device, "dtype": dtype, "samples": samples, "reply_tokens": reply_tokens,
                           "tokens_per_step": tokens, "threads": threads, "lora_rank": tc.lora_rank,
                           "steps": steps, "warmup": warmup, "rounds": rounds, "finetune": finetune,
                           "nproc": nproc, "runs": {}}
    python = trl_python or os.environ.get(TRL_ENV)
    jobs: list[tuple[str, str, dict[str, Any]]] = []
    if finetune != "lora":
        python = None
        console.print("finetune = full: ours only (the TRL side is a LoRA step).")
    elif python:
        jobs.append(("trl", python, {"side": "trl", "checkpointing": False}))
        if trl_checkpointing:
            jobs.append(("trl_checkpointing", python, {"side": "trl", "checkpointing": True}))
    else:
        console.print(f"[yellow]{TRL_MISSING}[/]\nMeasuring ours only.")
    for m in micro_batches:
        jobs.append((f"ours_mb{m}", sys.executable, {"side": "ours", "micro_batch": m}))
        if nproc > 1:
            jobs.append((f"ours_mb{m}_x{nproc}", sys.executable,
                         {"side": "ours", "micro_batch": m, "nproc": nproc, "threads": max(1, threads // nproc)}))
        if quantize != "none":
            jobs.append((f"ours_mb{m}_{quantize}", sys.executable, {"side": "ours", "micro_batch": m,
                                                                   "quantize": quantize}))
    for round_ in range(rounds):
        for name, exe, extra in jobs:
            with console.status(f"round {round_ + 1}/{rounds}, {name}: {warmup} warm-up + {steps} timed steps of "
                                f"{samples} x {reply_tokens} tokens..."):
                result = run_side(exe, {**base, **extra}, timeout_s)
            out["runs"][name] = best_of(out["runs"].get(name), result)
            console.print(f"{name}: " + (f"[red]{result['error']}[/]" if "error" in result else
                                         f"{result['step_s']:.2f} s/step, {result['tokens_per_s']:.1f} tokens/s, "
                                         f"{result['cpu_s']:.1f} CPU-s/step, peak {result['peak_gb']:.2f} GB"))
    out.update(compare(out["runs"]))
    console.print(table(out))
    return out


def make_batch(model: Path, samples: int, reply_tokens: int, seed: int = 0) -> dict[str, Any]:
    """Rendered chat prompts and seeded random replies (ids from the ordinary, non-special vocabulary)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    special = set(tokenizer.all_special_ids)
    prompts = []
    for i in range(samples):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                            add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    rng = random.Random(seed)
    ordinary = [t for t in range(len(tokenizer)) if t not in special]
    replies = [[rng.choice(ordinary) for _ in range(reply_tokens)] for _ in range(samples)]
    rewards = [1.0 if i % 2 == 0 else -1.0 for i in range(samples)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return {"prompts": prompts, "replies": replies, "rewards": rewards, "pad_id": pad}


def run_side(python: str, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One side in a fresh process (or `spec["nproc"]` rank processes, the environment torchrun
    would give them); the last stdout line of rank 0 is the JSON result."""
    from clawr1.trainer.ranks import free_port

    nproc = spec.get("nproc", 1)
    with tempfile.TemporaryDirectory(prefix="clawr1-bench-trainer-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               # one process per side: OpenMP must not spin up more threads than we ask torch for
               "OMP_NUM_THREADS": str(spec["threads"]), "MKL_NUM_THREADS": str(spec["threads"])}
        # The TRL venv has no clawr1, so the worker runs as a script by path; ours may as well.
        cmd = [python, str(Path(__file__).resolve()), "--spec", str(spec_path), "--workdir", tmp]
        port = free_port()
        logs = [Path(tmp) / f"rank{r}.log" for r in range(nproc)]
        sinks = [open(log, "w") for log in logs[1:]]  # noqa: SIM115 (closed below)
        procs = []
        for r in range(nproc):  # rank 0 on pipes (its result); the others into files, never blocking on a pipe
            ranks = ({"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": str(port)} if nproc > 1 else {})
            sink = subprocess.PIPE if r == 0 else sinks[r - 1]
            procs.append(subprocess.Popen(cmd, stdout=sink, stderr=sink, text=True, env={**env, **ranks}))
        try:
            out, err = procs[0].communicate(timeout=timeout_s)
            for p in procs[1:]:
                p.wait(timeout=timeout_s)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for sink in sinks:
                sink.close()
        errors = [err] + [log.read_text() for log in logs[1:]]
    lines = [line for line in out.splitlines() if line.startswith("{")]
    failed = [(p.returncode, e) for p, e in zip(procs, errors, strict=True) if p.returncode != 0]
    if failed or not lines:
        code, text = failed[0] if failed else (0, err)
        tail = "\n".join(text.strip().splitlines()[-15:])
        return {"error": f"exit {code}: {tail or out[-2000:]}"}
    return json.loads(lines[-1])


def best_of(best: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """The faster of two runs of one setting, with every run's median step time kept in `round_step_s`."""
    medians = (best or {}).get("round_step_s", []) + ([new["step_s"]] if "step_s" in new else [])
    if best is None or "step_s" not in best or ("step_s" in new and new["step_s"] < best["step_s"]):
        best = new
    return {**best, "round_step_s": medians}


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ratios of each of our settings to TRL, and the goal check (met by any one setting)."""
    trl = runs.get("trl", {})
    out: dict[str, Any] = {}
    if "tokens_per_s" not in trl:
        return out
    met, met_cpu = [], []
    for name, r in runs.items():
        if not name.startswith("ours") or "tokens_per_s" not in r:
            continue
        r["speedup_vs_trl"] = r["tokens_per_s"] / trl["tokens_per_s"]
        r["memory_vs_trl"] = r["peak_gb"] / trl["peak_gb"]
        small = r["memory_vs_trl"] <= GOAL_MEMORY
        if small and r["speedup_vs_trl"] >= GOAL_SPEEDUP:
            met.append(name)
        if "tokens_per_cpu_s" in r and "tokens_per_cpu_s" in trl:  # CPU time: fair on a shared machine
            r["cpu_speedup_vs_trl"] = r["tokens_per_cpu_s"] / trl["tokens_per_cpu_s"]
            if small and r["cpu_speedup_vs_trl"] >= GOAL_SPEEDUP:
                met_cpu.append(name)
    out.update(goal_met_by=met, goal_met=bool(met), goal_met_by_cpu_time=met_cpu)
    return out


def table(numbers: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=(f"Train step: {numbers['model']}{' (random weights)' if numbers['random_weights'] else ''}, "
                     f"{numbers['samples']} x {numbers['reply_tokens']} reply tokens, "
                     f"LoRA r={numbers['lora_rank']}, {numbers['threads']} threads, {numbers['device']} {numbers['dtype']} "
                     f"(median of {numbers['steps']} after {numbers['warmup']} warm-up"
                     + (f", best of {numbers['rounds']} rounds)" if numbers["rounds"] > 1 else ")")))
    peak = "peak GPU GB" if numbers["device"].startswith("cuda") else "peak RSS GB"
    columns = ("run", "s/step", "tokens/s", "tokens/CPU-s", peak, "tokens/s vs TRL", "tokens/CPU-s vs TRL",
               "peak vs TRL", "load avg")
    for column in columns:
        t.add_column(column, justify="left" if column == "run" else "right")
    for name, r in numbers["runs"].items():
        if "error" in r:
            t.add_row(name, "[red]failed[/]", r["error"].splitlines()[-1][:60], *[""] * (len(columns) - 3))
            continue
        speed, cpu, memory = r.get("speedup_vs_trl"), r.get("cpu_speedup_vs_trl"), r.get("memory_vs_trl")
        t.add_row(name, f"{r['step_s']:.2f}", f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_cpu_s']:.1f}",
                  f"{r['peak_gb']:.2f}", _check(speed, speed is not None and speed >= GOAL_SPEEDUP),
                  _check(cpu, cpu is not None and cpu >= GOAL_SPEEDUP),
                  _check(memory, memory is not None and memory <= GOAL_MEMORY), f"{max(r['load_avg_1m']):.1f}")
    if "goal_met" in numbers:
        def verdict(names: list[str]) -> str:
            return f"[green]met by {', '.join(names)}[/]" if names else "[red]missed[/]"

        t.caption = (f"Goal >= {GOAL_SPEEDUP}x TRL tokens/s at <= {GOAL_MEMORY:.0%} of its peak: "
                     f"{verdict(numbers['goal_met_by'])} (by CPU time: {verdict(numbers['goal_met_by_cpu_time'])}). "
                     f"Load avg: the machine's 1-minute load during the timed steps ({os.cpu_count()} CPUs); "
                     "above the thread count, wall times are inflated and tokens/CPU-s at 1 thread is the fair "
                     "measure.")
    return t


def _check(value: float | None, ok: bool) -> str:
    if value is None:
        return "-"
    return f"[{'green' if ok else 'red'}]{value:.2f}x[/]"


# ---- the workers: one side, one setting, one process -----------------------------------------------

def measure(step: Callable[[], Any], warmup: int, steps: int, tokens: int, device: str = "cpu") -> dict[str, Any]:
    """Warm-up steps, then reset the peak-memory marks and time `steps` steps (on CUDA, each step
    ends with a synchronize, and the peak is the device's allocator's)."""
    cuda = device.startswith("cuda")
    if cuda:
        import torch

        inner = step

        def step() -> None:
            inner()
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    gc.collect()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    _trim()  # RSS down to what is live, so the timed steps' peak is theirs, not the warm-up's freed heap
    reset = _reset_peak()
    before = _rss_kb("VmRSS")
    load = os.getloadavg()[0]  # other work on the machine skews timings: report it
    times, cpu = [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    peak = _rss_kb("VmHWM") if reset else _ru_maxrss_kb()
    median = statistics.median(times)
    # cpu_s: CPU seconds of all this process's threads in a median step; about threads x step_s on an
    # idle machine, less when other processes take the cores. With one thread it is the step's work
    # whatever else runs (no spinning OpenMP siblings): the comparison that survives a busy machine.
    cpu_median = statistics.median(cpu)
    gpu_peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"step_s": median, "step_times_s": times, "tokens_per_s": tokens / median, "cpu_s": cpu_median,
            "tokens_per_cpu_s": tokens / cpu_median, "peak_gb": gpu_peak if cuda else peak / 2**20,
            "peak_gpu_gb": gpu_peak, "peak_rss_gb": peak / 2**20, "rss_before_gb": before / 2**20,
            "peak_scope": "timed steps" if reset else "whole process (VmHWM reset unavailable)",
            "load_avg_1m": [load, os.getloadavg()[0]]}


def _trim() -> None:
    """Return glibc's freed heap to the kernel (malloc_trim): without it, memory the warm-up
    freed still counts in RSS, and the peak of the timed steps would include it."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None or not hasattr(ctypes.CDLL(name), "malloc_trim"):
        print("malloc_trim unavailable (not glibc): peaks include freed heap", file=sys.stderr)
        return
    ctypes.CDLL(name).malloc_trim(0)


def _reset_peak() -> bool:
    """Reset this process's peak-RSS mark (Linux >= 4.0), so the peak excludes model loading."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as e:  # not Linux, or /proc read-only: fall back to the whole-process peak
        print(f"peak RSS reset unavailable ({e}); reporting the whole-process peak", file=sys.stderr)
        return False
    return True


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _ru_maxrss_kb() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux


def worker_ours(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    import torch

    from clawr1.core.config import Config
    from clawr1.core.records import Step
    from clawr1.datapool import SQLitePool
    from clawr1.trainer.batch import TrainSample
    from clawr1.trainer.loop import Trainer
    from clawr1.trainer.policy import pack
    from clawr1.trainer.ranks import Ranks

    n = len(spec["replies"])
    config = Config.model_validate({
        "data_dir": str(workdir), "engine": {"model": spec["model"]}, "guard": {"enabled": False},
        "trainer": {"method": "rl", "batch_size": n, "finetune": spec.get("finetune", "lora"),
                    "micro_batch": spec["micro_batch"], "threads": spec["threads"],
                    "quantize": spec.get("quantize", "none"),
                    "micro_batch_tokens": 10_000_000,  # the sample count is the setting measured
                    "device": spec["device"], "dtype": spec["dtype"], "grad_checkpointing": spec["grad_checkpointing"],
                    "lora_rank": spec["lora"]["r"], "lora_alpha": spec["lora"]["alpha"],
                    "lora_targets": spec["lora"]["targets"], "lr": spec["lr"], "grad_clip": spec["grad_clip"],
                    "eps_low": spec["eps_low"], "eps_high": spec["eps_high"],
                    # No KL at all, as TRL at beta = 0: no penalty and no `kl_base` metric (its base
                    # forward is a quarter of a step; `trainer.kl_base_every`).
                    "kl_coef": 0.0, "kl_base_every": 0}})
    policy = None
    if spec["shape"]:
        from clawr1.trainer.policy import Policy

        policy = Policy(Path(spec["model"]), config.trainer, base=_shaped(spec))
    with SQLitePool(workdir, config.pool) as pool:
        ranks = Ranks.from_env(spec["device"])  # rank 0 of 1 unless run as `nproc` ranks
        trainer = Trainer(config, pool, resume=False, policy=policy, ranks=ranks)
        prompts, replies = spec["prompts"], spec["replies"]
        with torch.no_grad():
            behaviour = trainer.policy.logprobs(pack(prompts, replies, [1.0] * n, trainer.policy.pad_id))
        k = behaviour.shape[1]
        samples = []
        for i, (p, r) in enumerate(zip(prompts, replies, strict=True)):
            # Each sample its own prompt id: GRPO normalisation leaves the +1/-1 rewards as they are,
            # the same advantages TRL gets.
            step = Step(step_id=f"b{i}", tenant="default", session_id=f"s{i}", prompt_id=f"p{i}", turn_index=0,
                        turn_type="main", messages=[], tools=None, prompt_ids=p, token_ids=r,
                        logprobs=behaviour[i, k - len(r):].tolist(), text="", policy_version=0, adapter=None,
                        finish_reason="length", temperature=1.0)
            samples.append(TrainSample(step, spec["rewards"][i]))
        last: dict[str, Any] = {}

        def one_step() -> None:
            last.update(trainer.train_step(samples))

        before = _snapshot(trainer.policy.model)
        out = measure(one_step, spec["warmup"], spec["steps"], sum(len(r) for r in replies), spec["device"])
        out["lora_updated"] = _updated(trainer.policy.model, before)
        ranks.close()
    out.update(micro_batch=spec["micro_batch"], ranks=ranks.world, finetune=config.trainer.finetune,
               grad_checkpointing=spec["grad_checkpointing"], threads=torch.get_num_threads(), torch=torch.__version__,
               trained_tokens=last["tokens"], ratio=last["ratio"], prepare_s=last["prepare_s"])
    return out


def worker_trl(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    n, replies = len(spec["replies"]), spec["replies"]
    k = max(len(r) for r in replies)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    cpu, dtype = spec["device"] == "cpu", getattr(torch, spec["dtype"] if spec["dtype"] != "auto" else "float32")
    model = (_shaped(spec) if spec["shape"] else
             AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).to(spec["device"]))
    args = GRPOConfig(
        output_dir=str(workdir / "trl"), per_device_train_batch_size=n, gradient_accumulation_steps=1,
        num_generations=n, max_completion_length=k, use_cpu=cpu, bf16=dtype == torch.bfloat16,  # as ours
        gradient_checkpointing=spec["checkpointing"], learning_rate=spec["lr"], max_grad_norm=spec["grad_clip"],
        epsilon=spec["eps_low"], epsilon_high=spec["eps_high"], beta=0.0, report_to=[], save_strategy="no",
        logging_steps=10**9, seed=0)
    lora = LoraConfig(r=spec["lora"]["r"], lora_alpha=spec["lora"]["alpha"], target_modules=spec["lora"]["targets"],
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=_zero_reward, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": ["-"] * n}), peft_config=lora)
    torch.set_num_threads(spec["threads"])  # in case accelerate changed it
    # What `Trainer.train()` sets up before its loop (non-distributed path): checkpointing is only
    # switched on there, then the optimizer, `accelerator.prepare` and the scheduler.
    if args.activation_checkpointing:
        trainer.model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=args.activation_checkpointing_kwargs or None)
    trainer.create_optimizer()
    model_, trainer.optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
    trainer.create_scheduler(num_training_steps=spec["warmup"] + spec["steps"])
    trainer.current_gradient_accumulation_steps = 1  # normally set by the training loop we bypass
    trainer._prepare_inputs = lambda batch: batch  # the batch is already generated and scored

    pad = spec["pad_id"]
    width = max(len(p) for p in spec["prompts"])
    on = model_.device
    prompt_ids = torch.tensor([[pad] * (width - len(p)) + p for p in spec["prompts"]], device=on)  # left-padded
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in spec["prompts"]], device=on)
    completion_ids = torch.tensor([r + [pad] * (k - len(r)) for r in replies], device=on)  # right-padded
    completion_mask = torch.tensor([[1] * len(r) + [0] * (k - len(r)) for r in replies], device=on)
    with torch.no_grad():
        old, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), k)
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": torch.tensor(spec["rewards"], device=on),
              "old_per_token_logps": old, "num_items_in_batch": completion_mask.sum()}

    def one_step() -> None:
        # What the Trainer loop does per optimizer step with one micro-batch (gradient_accumulation_steps=1).
        trainer.training_step(model_, inputs, inputs["num_items_in_batch"])
        trainer._clip_grad_norm(model_)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        model_.zero_grad()

    before = _snapshot(model_)
    out = measure(one_step, spec["warmup"], spec["steps"], int(completion_mask.sum()), spec["device"])
    out["lora_updated"] = _updated(model_, before)
    active = trainer.model.get_base_model().is_activation_checkpointing
    out.update(checkpointing=spec["checkpointing"], checkpointing_active=active, threads=torch.get_num_threads(),
               torch=torch.__version__, trl=trl.__version__, optim=str(args.optim), loss_type=args.loss_type)
    return out


def _shaped(spec: dict[str, Any]) -> Any:
    """A randomly initialised model of `spec["shape"]` (a config dict), built on the device in
    the dtype asked for (seeded: both sides build the same one)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(spec["shape"])
    config = AutoConfig.for_model(shape.pop("model_type"), **shape)
    torch.manual_seed(0)
    dtype = spec["dtype"] if spec["dtype"] != "auto" else ("bfloat16" if spec["device"].startswith("cuda") else "float32")
    with torch.device(spec["device"]):
        return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))


def _snapshot(model: Any) -> dict[str, Any]:
    return {n: _local(p).clone() for n, p in model.named_parameters() if p.requires_grad}


def _updated(model: Any, before: dict[str, Any]) -> bool:
    """Whether every trainable tensor (LoRA, or every weight) moved: proof that the timed steps
    trained. On sharded ranks: this rank's shard of each."""
    import torch

    now = dict(model.named_parameters())
    return bool(before) and all(not torch.equal(_local(now[n]), p) for n, p in before.items() if p.numel())


def _local(t: Any) -> Any:
    """A parameter's tensor on this rank: its shard when FSDP2 sharded it (a DTensor)."""
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def _zero_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    return [0.0] * len(completions)  # never called: generation and scoring are bypassed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one side of `clawr1 bench trainer` (internal)")
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    worker = worker_trl if spec["side"] == "trl" else worker_ours
    print(json.dumps(worker(spec, args.workdir)), flush=True)
    return 0


if __name__ == "__main__":
    # Run by path, this file's directory (engine.py, gateway.py, trainer.py, ...) would shadow
    # top-level modules of the same names: drop it from the import path.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != here]
    raise SystemExit(main())
