"""`clawr1 bench precision` on the tiny model: the engine's own dtype rescores its replies exactly
(ratio 1), and every other trainer precision shows as a mismatch."""

import importlib.util
import io

import pytest
from rich.console import Console

from benchmarks import precision as bench
from clawr1.core.config import load_config


def test_the_engines_dtype_gives_ratio_one_and_the_others_a_mismatch(tiny_model_dir, tmp_path):
    config = load_config(None, [f'data_dir="{tmp_path}"', f'engine.model="{tiny_model_dir}"'])
    out = io.StringIO()
    numbers = bench.run(config, Console(file=out, width=200), prompts=3, max_tokens=8)
    bases = numbers["bases"]
    own, head, full = bases["bfloat16 (engine's own)"], bases["bfloat16, float32 head"], bases["float32 (baseline)"]
    assert own["tokens"] == head["tokens"] == full["tokens"] > 3
    assert own["mean_abs_log_ratio"] == 0 and own["outside_clip"] == 0  # the same maths as the sampler
    assert head["mean_abs_log_ratio"] > 0 and full["mean_abs_log_ratio"] > 0  # rounding the logits, the weights
    assert "PPO ratio at step 0" in out.getvalue()
    if importlib.util.find_spec("bitsandbytes") is None:
        assert "not installed" in bases["NF4 (QLoRA)"]["skipped"]


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes: the qlora extra")
def test_nf4_changes_every_decoder_linear_weight_and_nothing_else(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    quantized = bench.nf4(model)
    changed = {n for n, p in quantized.named_parameters() if not torch.equal(p, dict(model.named_parameters())[n])}
    linear = {f"model.{n}.weight" for n, m in model.get_decoder().named_modules() if isinstance(m, torch.nn.Linear)}
    assert changed == linear and linear
