"""SGLang as the serving engine (`engine.backend = "sglang"`), by its native HTTP API.

Start the server with run-time LoRA: `python -m sglang.launch_server --model-path PATH
--enable-lora --max-lora-rank 8 --lora-target-modules all --max-loras-per-batch 4`.

- sampling: `POST /generate` with `input_ids`, `sampling_params` (`max_new_tokens`, `temperature`,
  `top_p`, `top_k`, `stop`, `sampling_seed`) and `return_logprob`; the sampled ids and their logprobs come
  back as `meta_info.output_token_logprobs`, `[logprob, token_id, ...]` each. A request is not
  streamed (its tokens reach the gateway when it ends): the contract holds, the granularity is
  coarser;
- scoring: `/generate` over prompt + completion with `max_new_tokens: 0` and
  `logprob_start_len`, read from `meta_info.input_token_logprobs`;
- adapters: `POST /load_lora_adapter` / `/unload_lora_adapter` (`lora_name`, `lora_path`); a
  request names its adapter as `lora_path`;
- full weights: `POST /update_weights_from_disk` (`model_path`), see `load_weights`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from clawr1.core.types import AdapterError, Generation, SamplingParams
from clawr1.engine import adapters as store
from clawr1.engine.remote import RemoteEngine, raise_for_status


class SGLangEngine(RemoteEngine):
    async def _sample(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int,
                      served: str | None, gen: Generation) -> AsyncIterator[tuple[int, float]]:
        params: dict = {"max_new_tokens": max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
                        "top_k": sampling.top_k or -1}
        if sampling.stop:
            params["stop"] = list(sampling.stop)
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        body: dict = {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True}
        if served is not None:
            body["lora_path"] = served
        response = await self.client.post("/generate", json=body)
        raise_for_status(response, "SGLang /generate")
        meta = response.json()["meta_info"]
        weights = str(meta.get("weight_version", ""))
        if served is None and weights.isdigit():  # the weights that sampled it, told by the server
            gen.version = int(weights)
        for entry in meta["output_token_logprobs"]:
            yield int(entry[1]), float(entry[0])

    async def _score(self, ids: list[int], start: int, served: str | None) -> list[float]:
        body: dict = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
                      "return_logprob": True, "logprob_start_len": start}
        if served is not None:
            body["lora_path"] = served
        response = await self.client.post("/generate", json=body)
        raise_for_status(response, "SGLang /generate (input logprobs)")
        entries = response.json()["meta_info"]["input_token_logprobs"]
        return [float(entry[0]) for entry in entries[-(len(ids) - start):]]

    async def _load(self, served: str, path: Path) -> None:
        response = await self.client.post("/load_lora_adapter", json={"lora_name": served, "lora_path": str(path)})
        raise_for_status(response, f"SGLang load_lora_adapter {served}")

    async def _unload(self, served: str) -> None:
        response = await self.client.post("/unload_lora_adapter", json={"lora_name": served})
        raise_for_status(response, f"SGLang unload_lora_adapter {served}")

    async def load_weights(self, path: Path) -> int:
        """Full fine-tuning: the server reloads every weight from a published directory and tags
        what it samples from then on with our version (`weight_version`), so each generation
        says which weights produced it. SGLang applies it between batches, so no request fails."""
        version = int(store.read_weights_marker(Path(path))["version"])
        response = await self.client.post("/update_weights_from_disk", json={
            "model_path": str(Path(path).resolve()), "weight_version": str(version)})  # noqa: ASYNC240 - once a version
        raise_for_status(response, "SGLang update_weights_from_disk")
        if not response.json().get("success", False):
            raise AdapterError(f"SGLang did not load the weights at {path}: {response.json().get('message')}")
        self._weights_version = version
        return version
