"""What the trainer's precision does to the PPO importance ratio: a float32 head, a float32 base,
QLoRA's 4-bit base, each against a bfloat16 engine.

With `trainer.quantize = "4bit"` the trainer computes with NF4 base weights (bitsandbytes,
double-quantized blocks of 64, bfloat16 compute) while the engine serves the bfloat16 base, so
before any training (LoRA's B starts at zero: the adapter adds nothing) the trainer's probability
of a sampled token is not the engine's. The PPO ratio the loss sees at step 0 is then that
mismatch alone, and every token whose ratio falls outside the clip (`trainer.eps_low`,
`trainer.eps_high`) has its gradient cut before the policy has moved at all.

One run, the configured model (`--model`), on the CPU: the bfloat16 base samples replies to the
demo's held-out questions at temperature 1 (its logprobs are the engine's), and each trainer base
rescores them: the bfloat16 base itself (must be exactly 1: the check that the maths is the
engine's), the same with its LM head computed in float32 (what rounding the logits to bfloat16
costs: the noise both sides' bfloat16 heads put into the ratio), the float32 base (a float32 LoRA
trainer's mismatch, the baseline), and the NF4 base
(bitsandbytes' own `quantize_4bit`/`dequantize_4bit` of every decoder linear layer, as
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True)` stores them; the LM head
stays bfloat16, as transformers keeps it). Per base: the mean and 99th percentile of |log ratio|,
the share of tokens outside the clip, and the sampled KL(engine || trainer). bitsandbytes is the
`qlora` extra (`pip install -e '.[qlora]'`); without it the NF4 row says so.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from clawr1.core.config import Config
from clawr1.demo.questions import HELD_OUT
from clawr1.engine.models import resolve_model

SYSTEM = "You are a helpful assistant."


def nf4(model: Any) -> Any:
    """A copy of `model` whose decoder linear layers hold the weights bitsandbytes' NF4 storage
    gives back (blocks of 64, double-quantized absmax), in the model's dtype: what a 4-bit layer
    multiplies by (it dequantizes to its compute dtype first)."""
    import bitsandbytes.functional as bnbf

    quantized = copy.deepcopy(model)
    with torch.no_grad():
        for module in quantized.get_decoder().modules():
            if isinstance(module, torch.nn.Linear):
                weight = module.weight.data
                packed, state = bnbf.quantize_4bit(weight.float(), blocksize=64, compress_statistics=True,
                                                   quant_type="nf4")
                module.weight.data = bnbf.dequantize_4bit(packed, state).to(weight.dtype)
    return quantized


def token_logprobs(model: Any, rows: list[tuple[list[int], list[int]]], float_head: bool = False) -> list[torch.Tensor]:
    """Each reply's token logprobs under `model` at temperature 1 (float32 log-softmax); with
    `float_head`, the LM head's matmul in float32 on the model's own hidden states (the logits
    never rounded to the model's dtype)."""
    out = []
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        for prompt, reply in rows:
            ids = torch.tensor([prompt + reply])
            if float_head:
                hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0, len(prompt) - 1:-1]
                logits = torch.nn.functional.linear(hidden.float(), head.float())
            else:
                logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(reply)[:, None])[:, 0])
    return out


def mismatch(engine: list[torch.Tensor], trainer: list[torch.Tensor], eps_low: float, eps_high: float) -> dict[str, Any]:
    log_ratio = torch.cat(trainer) - torch.cat(engine)  # the PPO ratio at step 0, in logs
    ratio = log_ratio.exp()
    size = log_ratio.abs()
    return {"tokens": int(log_ratio.numel()), "mean_abs_log_ratio": float(size.mean()),
            "p99_abs_log_ratio": float(size.quantile(0.99)), "max_abs_log_ratio": float(size.max()),
            "outside_clip": float(((ratio < 1 - eps_low) | (ratio > 1 + eps_high)).float().mean()),
            "kl_engine_trainer": float((-log_ratio).mean())}  # sampled KL(engine || trainer)


def run(config: Config, console: Console | None = None, prompts: int = 16, max_tokens: int = 64,
        seed: int = 0) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    console = console or Console()
    path = resolve_model(config.engine.model, Path(config.data_dir))
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    served = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    rows = []
    with console.status(f"the bfloat16 base samples {prompts} replies ..."):
        for question in (HELD_OUT * 4)[:prompts]:
            prompt = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                    {"role": "user", "content": question}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
            prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
            out = served.generate(torch.tensor([prompt]), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                  max_new_tokens=max_tokens, pad_token_id=tokenizer.eos_token_id)
            rows.append((prompt, out[0, len(prompt):].tolist()))
    engine = token_logprobs(served, rows)
    tc = config.trainer
    numbers: dict[str, Any] = {"model": path.name, "prompts": prompts, "max_tokens": max_tokens,
                               "eps_low": tc.eps_low, "eps_high": tc.eps_high, "bases": {}}
    bases: list[tuple[str, Any, bool]] = [
        ("bfloat16 (engine's own)", lambda: served, False), ("bfloat16, float32 head", lambda: served, True),
        ("float32 (baseline)", lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), False)]
    if importlib.util.find_spec("bitsandbytes") is not None:
        bases.append(("NF4 (QLoRA)", lambda: nf4(served), False))
    else:
        numbers["bases"]["NF4 (QLoRA)"] = {
            "skipped": "bitsandbytes is not installed (pip install -e '.[qlora]')"}
    for name, build, float_head in bases:
        with console.status(f"rescoring with the {name} base ..."):
            numbers["bases"][name] = mismatch(engine, token_logprobs(build(), rows, float_head), tc.eps_low,
                                              tc.eps_high)
    console.print(table(numbers))
    return numbers


def table(numbers: dict[str, Any]) -> Table:
    t = Table(title=f"PPO ratio at step 0, trainer base vs the bfloat16 engine ({numbers['model']}, "
                    f"{numbers['prompts']} replies of up to {numbers['max_tokens']} tokens, T 1; "
                    f"clip [{1 - numbers['eps_low']:.2f}, {1 + numbers['eps_high']:.2f}]; KL: sampled KL(engine || trainer))")
    for column in ("trainer base", "tokens", "mean |log r|", "p99 |log r|", "max |log r|", "outside clip", "KL"):
        t.add_column(column, justify="left" if column == "trainer base" else "right")
    for name, m in numbers["bases"].items():
        if "skipped" in m:
            t.add_row(name, m["skipped"], *[""] * 5)
            continue
        t.add_row(name, str(m["tokens"]), f"{m['mean_abs_log_ratio']:.4f}", f"{m['p99_abs_log_ratio']:.4f}",
                  f"{m['max_abs_log_ratio']:.3f}", f"{m['outside_clip']:.2%}", f"{m['kl_engine_trainer']:.5f}")
    return t

