"""The inference server `clawr1 up` starts itself: with `engine.backend = "vllm"` or `"sglang"` and
no `engine.url`, a vLLM or SGLang server on the same model directory, LoRA hot-loading on, on a
free loopback port, its output in `<data_dir>/run/<backend>.log`, stopped with `up`. A GPU user
needs one command, not two terminals.

The commands follow each server's documented CLI: vLLM's OpenAI server (`--enable-lora`,
`--logprobs-mode processed_logprobs` so its logprobs are the temperature-scaled ones it sampled
from, `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` for `/v1/load_lora_adapter`), and SGLang's
`sglang.launch_server` (`--enable-lora`, `--lora-target-modules all`). Both answer `GET /health`
once they serve. `engine.server_python` names the Python that has the server installed (often
its own venv), `engine.server_args` adds arguments (`--gpu-memory-utilization 0.5` to share a
GPU with the trainer).

The server answers only to a random key made for each start, which `up` hands the remote engine
(`engine.api_key`): on a host with other users, an unkeyed server on loopback would let any of
them sample unrecorded or load adapters of their own into what the gateway serves. vLLM reads
it from its environment (`VLLM_API_KEY`: not on the command line, which every local user can read
in `ps`); SGLang takes `--api-key` only, so on a shared host its key is visible there.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx

from clawr1.core.config import Config
from clawr1.core.types import EngineFailure

SERVED_NAME = "clawr1"  # the base model's name on a server we start


def command(config: Config, model: Path, port: int, key: str) -> tuple[list[str], dict[str, str]]:
    """The server's command line and the environment it adds; `key`: the one it answers to."""
    e, python = config.engine, config.engine.server_python or sys.executable
    rank, dtype = str(config.trainer.lora_rank), e.dtype
    if e.backend == "vllm":
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
               "--enable-lora", "--max-lora-rank", rank, "--max-loras", "4",
               "--logprobs-mode", "processed_logprobs"]
        env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_API_KEY": key}
    elif e.backend == "sglang":
        cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
               "--port", str(port), "--dtype", dtype, "--enable-lora", "--max-lora-rank", rank,
               "--lora-target-modules", "all", "--max-loras-per-batch", "4", "--api-key", key]
        env = {}
    else:
        raise ValueError(f"engine.backend = {e.backend!r} has no server to start")
    return cmd + list(e.server_args), env


class InferenceServer:
    """One vLLM or SGLang server process for `clawr1 up`."""

    def __init__(self, config: Config, model: Path, log_path: Path):
        self.config, self.model, self.log_path = config, model, log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.url = ""
        self.key = secrets.token_urlsafe(32)  # the only key it answers to (`engine.api_key` for the gateway)

    def start(self) -> str:
        """Start it and wait until `/health` answers; its base URL. EngineFailure, with the tail of
        its log, when it exits or is not serving within `engine.server_start_timeout_s`."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd, env = command(self.config, self.model, port, self.key)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                     start_new_session=True)  # a Ctrl-C in the terminal goes to `up`, which stops it
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.config.engine.server_start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise EngineFailure(f"the {self.config.engine.backend} server exited with code "
                                    f"{self.proc.returncode} while starting; {self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0,
                             headers={"Authorization": f"Bearer {self.key}"}).status_code == 200:
                    return self.url
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.5)
        self.stop()
        raise EngineFailure(f"the {self.config.engine.backend} server did not serve within "
                            f"{self.config.engine.server_start_timeout_s:.0f} s; {self.tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace").strip().splitlines() if self.log_path.exists() else []
        return f"its log ({self.log_path}) ends:\n" + "\n".join(text[-lines:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
