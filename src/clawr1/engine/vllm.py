"""vLLM as the serving engine (`engine.backend = "vllm"`), by its OpenAI-compatible server's API.

Start the server so its logprobs are the ones it sampled from and LoRA adapters load at run time:

    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True python -m vllm.entrypoints.openai.api_server \\
        --model PATH --served-model-name clawr1 --enable-lora --max-lora-rank 8 --max-loras 4 \\
        --logprobs-mode processed_logprobs

- sampling: `POST /v1/completions` with the prompt as token ids, `logprobs: 0` and
  `return_tokens_as_token_ids` (each sampled token comes back as `token_id:N` with its logprob),
  streamed; `processed_logprobs` makes them the logprobs of the distribution it sampled from,
  temperature-scaled and cut by top-k and top-p as `engine/sampling.py` does (vLLM's default,
  `raw_logprobs`, is before both, so the importance ratio would be off);
- scoring: the same route with `prompt_logprobs: 0` over prompt + completion;
- adapters: `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` (`lora_name`, `lora_path`),
  and a request names its adapter as `model`. The adapter directory must be readable by the server.
- full weights: vLLM updates them through its weight-transfer engines (NCCL/IPC from a trainer
  process), not from a directory; LoRA is the supported path here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from clawr1.core.types import Generation, SamplingParams
from clawr1.engine.remote import RemoteEngine, raise_for_status, sse_json


class VLLMEngine(RemoteEngine):
    async def _model(self, served: str | None) -> str:
        if served is not None:
            return served
        if self.config.served_model is None:
            response = await self.client.get("/v1/models")
            raise_for_status(response, "vLLM /v1/models")
            self.config = self.config.model_copy(update={"served_model": response.json()["data"][0]["id"]})
        return self.config.served_model

    async def _sample(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int,
                      served: str | None, gen: Generation) -> AsyncIterator[tuple[int, float]]:
        body = {"model": await self._model(served), "prompt": prompt_ids, "max_tokens": max_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k or -1,
                "logprobs": 0,
                "return_tokens_as_token_ids": True, "stream": True, "skip_special_tokens": False}
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:  # the server stops early too; the stop itself is found here, in our decode
            body.update(stop=list(sampling.stop), include_stop_str_in_output=True)
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            raise_for_status(response, "vLLM /v1/completions")
            async for chunk in sse_json(response):
                for choice in chunk.get("choices", ()):
                    lp = choice.get("logprobs") or {}
                    for token, logprob in zip(lp.get("tokens", ()), lp.get("token_logprobs", ()), strict=True):
                        yield int(token.removeprefix("token_id:")), float(logprob)

    async def _score(self, ids: list[int], start: int, served: str | None) -> list[float]:
        body = {"model": await self._model(served), "prompt": ids, "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0}
        response = await self.client.post("/v1/completions", json=body)
        raise_for_status(response, "vLLM /v1/completions (prompt_logprobs)")
        rows = response.json()["choices"][0]["prompt_logprobs"]
        return [float(rows[i][str(ids[i])]["logprob"]) for i in range(start, len(ids))]

    async def _load(self, served: str, path: Path) -> None:
        response = await self.client.post("/v1/load_lora_adapter", json={"lora_name": served, "lora_path": str(path)})
        raise_for_status(response, f"vLLM load_lora_adapter {served}")

    async def _unload(self, served: str) -> None:
        response = await self.client.post("/v1/unload_lora_adapter", json={"lora_name": served})
        raise_for_status(response, f"vLLM unload_lora_adapter {served}")
