"""An SGLang server for the contract test: SGLang needs a GPU, so this speaks its documented native
API (docs/basic_usage/native_api and sampling_params, io_struct.GenerateReqInput) in front of the
real local engine. Requests are validated strictly: a field SGLang does not document is a 400,
so the client cannot drift from the real API unnoticed.

Documented shapes used:
- `POST /generate` {input_ids, sampling_params{max_new_tokens, temperature, top_p, top_k (-1: off), stop,
  sampling_seed}, return_logprob, logprob_start_len, lora_path} -> {text, output_ids, meta_info{
  finish_reason{type}, prompt_tokens, completion_tokens, output_token_logprobs [[logprob, id,
  null]], input_token_logprobs (from logprob_start_len; the first prompt token has null),
  weight_version}}
- `POST /load_lora_adapter` {lora_name, lora_path}, `POST /unload_lora_adapter` {lora_name}
- `POST /update_weights_from_disk` {model_path, weight_version} -> {success, message}
- `GET /health` -> 200 once serving
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from clawr1.core.types import SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Sampling(_Strict):
    max_new_tokens: int = Field(128, ge=0)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] | None = None
    sampling_seed: int | None = None


class GenerateReq(_Strict):
    input_ids: list[int]
    sampling_params: Sampling = Sampling()
    return_logprob: bool = False
    logprob_start_len: int = -1
    lora_path: str | None = None
    stream: bool = False


class LoadLora(_Strict):
    lora_name: str
    lora_path: str


class UnloadLora(_Strict):
    lora_name: str


class UpdateWeights(_Strict):
    model_path: str
    weight_version: str | None = None


def sglang_app(engine: Any, api_key: str | None = None) -> FastAPI:
    """`api_key`: as `--api-key`, every request must carry it as a Bearer token (401 otherwise)."""
    app = FastAPI()
    app.state.requests = []  # every request body, for the test to inspect
    app.state.weight_version = "default"

    @app.middleware("http")
    async def keyed(request: Any, call_next: Any) -> Any:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health() -> Any:  # documented: 200 once the server serves
        return JSONResponse({})

    @app.post("/generate")
    async def generate(req: GenerateReq) -> Any:
        app.state.requests.append(("generate", req.model_dump()))
        meta: dict[str, Any] = {"prompt_tokens": len(req.input_ids), "weight_version": app.state.weight_version}
        adapter = req.lora_path
        if adapter is not None and adapter not in engine.adapters():
            return JSONResponse({"error": {"message": f"lora {adapter} not loaded"}}, status_code=400)
        s = req.sampling_params
        if s.max_new_tokens == 0:  # scoring: the logprobs of the prompt itself
            start = max(req.logprob_start_len, 0)
            scored = await engine.score(req.input_ids[:max(start, 1)], req.input_ids[max(start, 1):], adapter=adapter)
            entries = ([[None, req.input_ids[0], None]] if start == 0 else []) + [
                [lp, tid, None] for lp, tid in zip(scored, req.input_ids[max(start, 1):], strict=True)]
            meta.update(input_token_logprobs=entries, completion_tokens=0, finish_reason={"type": "length"})
            return {"text": "", "output_ids": [], "meta_info": meta}
        gen = await engine.generate(req.input_ids, SamplingParams(
            max_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=max(s.top_k, 0),
            stop=tuple(s.stop or ()),
            seed=s.sampling_seed), adapter=adapter).final()
        meta.update(completion_tokens=len(gen.token_ids), finish_reason={"type": gen.finish_reason})
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(gen.logprobs, gen.token_ids,
                                                                                  strict=True)]
        return {"text": gen.content, "output_ids": gen.token_ids, "meta_info": meta}

    @app.post("/load_lora_adapter")
    async def load(req: LoadLora) -> Any:
        app.state.requests.append(("load", req.model_dump()))
        await engine.load_adapter(req.lora_name, req.lora_path)
        return {"success": True, "loaded_adapters": sorted(engine.adapters())}

    @app.post("/unload_lora_adapter")
    async def unload(req: UnloadLora) -> Any:
        app.state.requests.append(("unload", req.model_dump()))
        await engine.unload_adapter(req.lora_name)
        return {"success": True, "loaded_adapters": sorted(engine.adapters())}

    @app.post("/update_weights_from_disk")
    async def update(req: UpdateWeights) -> Any:
        app.state.requests.append(("weights", req.model_dump()))
        version = await engine.load_weights(req.model_path)  # the real reload, in the engine behind
        app.state.weight_version = req.weight_version or str(version)
        return {"success": True, "message": "Succeeded to update model weights."}

    return app
