"""`clawr1 up` with `engine.backend = "sglang"` and no `engine.url` starts the server itself (here
SGLang's documented API in front of the local engine, `tests/sglang_fake.py`, run as the module
`sglang.launch_server` the real package provides), serves through it, and stops when it dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.gateway_helpers import free_port, healthy, interrupt, wait_for

ROOT = Path(__file__).resolve().parents[2]
FAKE = '''
import argparse, json, os, sys
from pathlib import Path
import uvicorn
from clawr1.core.config import EngineConfig
from clawr1.engine.local import LocalEngine
from tests.sglang_fake import sglang_app

parser = argparse.ArgumentParser()
for flag in ("--model-path", "--host", "--dtype", "--max-lora-rank", "--lora-target-modules", "--max-loras-per-batch"):
    parser.add_argument(flag)
parser.add_argument("--port", type=int)
parser.add_argument("--api-key")
parser.add_argument("--enable-lora", action="store_true")
args = parser.parse_args()  # an argument SGLang would not know fails here
Path(os.environ["FAKE_RECORD"]).write_text(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:],
                                                       "port": args.port}))
engine = LocalEngine.load(Path(args.model_path), EngineConfig(threads=1, max_batch=4))
uvicorn.run(sglang_app(engine, args.api_key), host=args.host, port=args.port, log_level="warning")
'''


def test_up_starts_the_sglang_server_serves_through_it_and_stops_when_it_dies(tiny_model_dir, tmp_path):
    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text(FAKE)
    record = tmp_path / "record.json"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "CLAWR1_DATA_DIR": "", "FAKE_RECORD": str(record),
           "PYTHONPATH": os.pathsep.join([str(fake.parent), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "clawr1.cli.main", "up", "--model", str(tiny_model_dir),
                             "--data-dir", str(tmp_path / "data"), "--port", str(port),
                             "--set", 'engine.backend="sglang"', "--set", "guard.enabled=false"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_for(lambda: healthy(base), timeout=180, what="clawr1 up to serve through its SGLang server")
        started = json.loads(record.read_text())
        assert "--enable-lora" in started["argv"] and started["argv"][started["argv"].index("--host") + 1] == "127.0.0.1"
        # Keyed: another local user reaches the server's port but can neither sample nor swap adapters.
        assert "--api-key" in started["argv"]
        stranger = httpx.post(f"http://127.0.0.1:{started['port']}/generate", json={"input_ids": [1]}, timeout=30)
        assert stranger.status_code == 401
        reply = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] is not None
        assert (tmp_path / "data" / "run" / "sglang.log").is_file()
        os.kill(started["pid"], signal.SIGKILL)  # the server dies: up cannot serve, so it stops
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            interrupt(proc)
    err = proc.stderr.read()
    assert proc.returncode == 1, err[-2000:]
    assert "sglang server exited" in err


def test_the_vllm_command_follows_its_documented_cli(tmp_path):
    from clawr1.core.config import load_config
    from clawr1.engine.launcher import SERVED_NAME, command

    config = load_config(None, ['engine.backend="vllm"', 'engine.dtype="bfloat16"', "trainer.lora_rank=16",
                                'engine.server_python="/opt/vllm/bin/python"',
                                'engine.server_args=["--gpu-memory-utilization", "0.5"]'])
    cmd, env = command(config, tmp_path, 8123, "k" * 43)
    assert cmd[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--model"] == str(tmp_path) and flags["--served-model-name"] == SERVED_NAME
    assert flags["--port"] == "8123" and flags["--host"] == "127.0.0.1" and flags["--dtype"] == "bfloat16"
    assert "--enable-lora" in cmd and cmd[cmd.index("--max-lora-rank") + 1] == "16"
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"  # the logprobs it sampled from
    assert cmd[-2:] == ["--gpu-memory-utilization", "0.5"]
    assert env == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_API_KEY": "k" * 43}  # the key: not in `ps`
    assert "k" * 43 not in " ".join(cmd)
