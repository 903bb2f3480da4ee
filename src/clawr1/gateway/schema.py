"""The OpenAI chat-completions wire format: request validation and response/chunk bodies."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from clawr1.core.types import Generation, ParsedCompletion, SamplingParams


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatRequest(BaseModel):
    """What we read of a request; unknown fields are ignored, as OpenAI does."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Any = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=8)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="only 0: the engine returns the sampled token's logprob")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str] | None:
        return [value] if isinstance(value, str) else value

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def sampling(self, default_max_tokens: int, seed_offset: int = 0) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            stop=tuple(self.stop or ()),
            seed=None if self.seed is None else self.seed + seed_offset,
        )


def fingerprint(version: int) -> str:
    """`system_fingerprint`: which policy version answered (`clawr1-v0` is the base model)."""
    return f"clawr1-v{version}"


def message_of(parsed: ParsedCompletion) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in parsed.tool_calls]
    return message


def finish_reason(gen: Generation, parsed: ParsedCompletion) -> str:
    if parsed.tool_calls:
        return "tool_calls"
    return "length" if gen.finish_reason == "length" else "stop"


def token_logprob(text: str, logprob: float) -> dict[str, Any]:
    """One entry of OpenAI's `logprobs.content` (no alternatives: `top_logprobs` is limited to 0)."""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}


def logprobs_of(gen: Generation, tokenizer: Any) -> dict[str, Any]:
    return {"content": [token_logprob(tokenizer.decode([t]), lp) for t, lp in zip(gen.token_ids, gen.logprobs)]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(cid: str, model: str, gens: list[Generation], parsed: list[ParsedCompletion],
                    with_logprobs: bool, tokenizer: Any) -> dict[str, Any]:
    choices = [{
        "index": i, "message": message_of(p), "finish_reason": finish_reason(g, p),
        "logprobs": logprobs_of(g, tokenizer) if with_logprobs else None,
    } for i, (g, p) in enumerate(zip(gens, parsed))]
    return {
        "id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "system_fingerprint": fingerprint(gens[0].version), "choices": choices,
        "usage": usage(len(gens[0].prompt_ids), sum(len(g.token_ids) for g in gens)),
    }


def chunk(cid: str, model: str, version: int, delta: dict[str, Any], finish: str | None = None,
          logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint(version),
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


class CompletionRequest(BaseModel):
    """`POST /v1/completions`: a raw prompt (text or token ids) for white-box use, no chat template."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(16, ge=1)  # OpenAI's default for this endpoint
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=8)
    logprobs: int | None = Field(None, ge=0, le=0, description="only 0: the sampled token's logprob, no alternatives")
    echo: bool = Field(False, description="not supported: the prompt is never repeated in the text")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False
    """vLLM's extension: each choice also carries `prompt_token_ids` and `token_ids`."""

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str] | None:
        return [value] if isinstance(value, str) else value

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if not value or (isinstance(value, list) and any(not p for p in value if isinstance(p, (str, list)))):
            raise ValueError("the prompt must not be empty")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo=true is not supported")
        return value

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]

    def sampling(self, seed_offset: int = 0) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, stop=tuple(self.stop or ()),
            seed=None if self.seed is None else self.seed + seed_offset)


def text_logprobs(gen: Generation, tokenizer: Any) -> dict[str, Any]:
    """The legacy completions `logprobs` object (no alternatives)."""
    tokens = [tokenizer.decode([t]) for t in gen.token_ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": list(gen.logprobs), "top_logprobs": None, "text_offset": offsets}


def text_choice(index: int, gen: Generation, req: CompletionRequest, tokenizer: Any, text: str,
                finish: str | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": finish,
                              "logprobs": text_logprobs(gen, tokenizer) if req.logprobs is not None and finish else None}
    if req.return_token_ids and finish:
        choice["prompt_token_ids"], choice["token_ids"] = gen.prompt_ids, gen.token_ids
    return choice


def text_finish(gen: Generation) -> str:
    return "length" if gen.finish_reason == "length" else "stop"
