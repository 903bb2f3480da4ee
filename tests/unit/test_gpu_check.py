"""`scripts/gpu_check.sh`, the prepared run for the first GPU machine, as its CPU dry run
(`DEVICE=cpu QUICK=1`): every step runs, tiny, and prints its figures beside their baselines, so the
script cannot rot before a GPU comes. A step that fails makes the run fail, saying which and how."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def gpu_check(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          check=False, timeout=1200, env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
                                             "QUICK": "1", **env})


def test_the_cpu_dry_run_passes_every_step_and_prints_each_figure_beside_its_baseline(tmp_path):
    # The limits are the GPU machine's; a shared CI runner converting the model in each run is slower.
    done = gpu_check(tmp_path, DEVICE="cpu", LIMIT_SCALE="4")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "every step passed" in done.stdout
    out = tmp_path / "out"
    for step in ("environment", "model", "engine", "lora", "ranks", "full", "swap"):
        assert "skipped" not in json.loads((out / f"{step}.json").read_text()), step
    assert "4-bit base weights need CUDA" in json.loads((out / "qlora.json").read_text())["skipped"]
    engine = json.loads((out / "engine.json").read_text())
    assert engine["engine_8_tok_s"] > 0 and engine["hf_seq_tok_s"] > 0
    lines = done.stdout.splitlines()
    for figure, baseline in (("8 concurrent, tokens/s", "HF, one at a time"), ("2 ranks, tokens/s", "one process"),
                             ("full fine-tuning, tokens/s", "LoRA step"), ("p99 ms while swapping", "steady p99")):
        [row] = [line for line in lines if figure in line]
        assert row.rstrip().endswith(baseline), row
    trained = json.loads((out / "full.json").read_text())["runs"]
    assert all(run["lora_updated"] for run in trained.values())  # every weight moved in the timed steps


def test_a_failed_step_fails_the_run_with_its_own_exit_status(tmp_path):
    """It printed "exit 0" for every failure (the status of `!`) and went on into steps that could
    not run. No CUDA device here: the environment step fails, nothing after it runs, the run fails."""
    done = gpu_check(tmp_path, DEVICE="cuda")
    assert done.returncode == 1
    assert "FAILED (exit 1)" in done.stdout and "no CUDA device visible" in done.stdout
    assert "FAILED steps: environment" in done.stdout and "not run" in done.stdout
