"""The trainer benchmark's own side on the tiny model (one subprocess, seconds), and its goal check."""

import io

from rich.console import Console

from benchmarks import trainer as bench
from clawr1.core.config import load_config


def test_ours_alone_produces_numbers_without_trl(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv(bench.TRL_ENV, raising=False)
    config = load_config(None, [f'data_dir="{tmp_path}"', f'engine.model="{tiny_model_dir}"'])
    out = io.StringIO()
    numbers = bench.run(config, Console(file=out, width=200), micro_batches=(2,), samples=2, reply_tokens=8,
                        threads=1, steps=1, warmup=1)
    assert list(numbers["runs"]) == ["ours_mb2"] and "goal_met" not in numbers
    r = numbers["runs"]["ours_mb2"]
    assert "error" not in r, r.get("error")
    assert r["tokens_per_s"] > 0 and r["tokens_per_cpu_s"] > 0 and r["step_s"] > 0 and r["peak_rss_gb"] > 0
    assert r["trained_tokens"] == 16 and r["micro_batch"] == 2 and r["threads"] == 1 and r["lora_updated"]
    text = out.getvalue()
    assert bench.TRL_ENV in text and "ours_mb2" in text


def test_a_shape_trains_a_random_model_of_that_architecture_in_bfloat16(tiny_model_dir, tmp_path, monkeypatch):
    """`--shape`: a model built from a config alone (no weights anywhere), here the tiny test shape
    in bfloat16 with checkpointing, through the same trainer."""
    monkeypatch.delenv(bench.TRL_ENV, raising=False)
    monkeypatch.setitem(bench.SHAPES, "test-tiny", {
        "model_type": "qwen2", "vocab_size": 50000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True})
    config = load_config(None, [f'data_dir="{tmp_path}"', f'engine.model="{tiny_model_dir}"'])
    numbers = bench.run(config, Console(file=io.StringIO(), width=200), micro_batches=(2,), samples=2,
                        reply_tokens=8, threads=1, steps=1, warmup=1, shape="test-tiny", dtype="bfloat16",
                        grad_checkpointing=True)
    r = numbers["runs"]["ours_mb2"]
    assert "error" not in r, r.get("error")
    assert numbers["random_weights"] and numbers["model"] == "test-tiny" and r["lora_updated"]
    assert r["trained_tokens"] == 16 and r["grad_checkpointing"] and r["peak_gb"] > 0


def test_ranks_run_beside_one_process_and_full_finetuning_trains_every_weight(tiny_model_dir, tmp_path,
                                                                              monkeypatch):
    """`--nproc 2 --finetune full`: each setting once as one process and once as two gloo ranks
    (FSDP2-sharded layers), both training every weight on the same batch."""
    monkeypatch.setenv(bench.TRL_ENV, "/nonexistent/python")  # full fine-tuning never runs the (LoRA) TRL side
    config = load_config(None, [f'data_dir="{tmp_path}"', f'engine.model="{tiny_model_dir}"'])
    numbers = bench.run(config, Console(file=io.StringIO(), width=200), micro_batches=(2,), samples=2,
                        reply_tokens=8, threads=2, steps=1, warmup=1, nproc=2, finetune="full")
    assert list(numbers["runs"]) == ["ours_mb2", "ours_mb2_x2"]
    one, two = numbers["runs"]["ours_mb2"], numbers["runs"]["ours_mb2_x2"]
    assert "error" not in one and "error" not in two, (one.get("error"), two.get("error"))
    assert (one["ranks"], two["ranks"]) == (1, 2) and one["finetune"] == two["finetune"] == "full"
    assert one["lora_updated"] and two["lora_updated"]  # every (local shard of every) weight moved
    assert one["trained_tokens"] == two["trained_tokens"] == 16 and two["threads"] == 1


def test_goal_needs_speed_and_memory_from_the_same_setting():
    def r(tokens_per_s, peak, tokens_per_cpu_s=None):
        return {"tokens_per_s": tokens_per_s, "tokens_per_cpu_s": tokens_per_cpu_s or tokens_per_s, "peak_gb": peak}

    runs = {"trl": r(100.0, 8.0),
            "ours_mb8": r(160.0, 6.0),  # fast enough, too big
            "ours_mb2": r(140.0, 3.0, 200.0)}  # small enough, too slow by the clock, fast enough by CPU time
    assert bench.compare(runs) == {"goal_met_by": [], "goal_met": False, "goal_met_by_cpu_time": ["ours_mb2"]}
    runs["ours_mb4"] = r(150.0, 4.0)
    assert bench.compare(runs)["goal_met_by"] == ["ours_mb4"]
    assert runs["ours_mb8"]["speedup_vs_trl"] == 1.6 and runs["ours_mb2"]["memory_vs_trl"] == 0.375
    assert runs["ours_mb2"]["cpu_speedup_vs_trl"] == 2.0
    assert bench.compare({"ours_mb2": r(1.0, 1.0)}) == {}


def test_best_of_rounds_keeps_the_fastest_run_and_every_median():
    best = bench.best_of(None, {"step_s": 3.0, "peak_rss_gb": 2.0})
    best = bench.best_of(best, {"error": "exit 1"})
    best = bench.best_of(best, {"step_s": 2.0, "peak_rss_gb": 2.1})
    assert best == {"step_s": 2.0, "peak_rss_gb": 2.1, "round_step_s": [3.0, 2.0]}
    assert bench.best_of(None, {"error": "exit 1"})["error"] == "exit 1"
