"""The OpenAI chat-completions wire format: request validation and response/chunk bodies.

Validation is whole and happens before admission: every message, content part, tool call and tool
is typed here, so a malformed request is a 400 that never reaches the engine or the pool. Unknown
fields are ignored, as OpenAI's SDKs expect, in messages, content parts and tool calls too: what a
step stores of a message is what its chat template rendered, so every stored byte passed the
context check (an unknown field of megabytes, stored once per choice, once filled a disk). A tool's
function keeps its extra fields: the template renders the function whole.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema, field_validator, model_validator

from clawr1.core.types import Generation, ParsedCompletion, SamplingDefaults, SamplingParams
from clawr1.gateway.errors import APIError

TEXT_PARTS = ("text", "input_text", "output_text")
SEED = Field(None, ge=-(2**62), le=2**62)  # the engine's generator takes 64-bit seeds; n > 1 adds offsets
MAX_TOKENS = 1 << 24  # beyond any context: the engine clamps to the room left


def _content(value: Any) -> Any:
    """A message's content: a string, null, or an array of text parts (a text model takes no other)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("content must be a string, null, or an array of text parts")
    for i, part in enumerate(value):
        if not isinstance(part, dict):
            raise ValueError(f"content part {i} must be an object")
        if part.get("type") not in TEXT_PARTS:
            raise ValueError(f"content part {i} has type {part.get('type')!r}: a text model takes only "
                             f"{' / '.join(TEXT_PARTS)} parts")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"content part {i} needs a string `text`")
    return [{"type": part["type"], "text": part["text"]} for part in value]  # no unknown fields: see above


_TEXT_PART_SCHEMA = {"type": "object", "required": ["type", "text"],
                     "properties": {"type": {"enum": list(TEXT_PARTS)}, "text": {"type": "string"}}}
Content = Annotated[Any, PlainValidator(_content), WithJsonSchema(
    {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": _TEXT_PART_SCHEMA}]})]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=256)
    arguments: str | dict[str, Any] = "{}"
    """A JSON string, as OpenAI sends it (an object is accepted too)."""


class ToolCallIn(BaseModel):
    """A tool call in an assistant message of the history."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message of the conversation. `developer` is rendered as `system`."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _per_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"a {self.role} message cannot carry tool_calls (only assistant messages do)")
        if self.content is None and self.role in ("system", "developer", "user", "tool"):
            raise ValueError(f"a {self.role} message needs content")
        return self


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: rendered like `auto` (the engine cannot
    force a call)."""

    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatRequest(BaseModel):
    """What we read of a request; unknown fields are ignored, as OpenAI does."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1, max_length=256)
    messages: list[ChatMessage] = Field(min_length=1, max_length=100_000)
    tools: list[Tool] | None = Field(None, max_length=1024)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=1_000_000, description="vLLM's extension (0: all tokens)")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    stop: str | list[str] | None = Field(None, max_length=4)
    seed: int | None = SEED
    n: int = Field(1, ge=1, le=8)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="only 0: the engine returns the sampled token's logprob")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=4096)
    safety_identifier: str | None = Field(None, max_length=4096)  # `user`'s successor in OpenAI's API

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str] | None:
        return [value] if isinstance(value, str) else value

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def sampling(self, default_max_tokens: int, defaults: SamplingDefaults, seed_offset: int = 0) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
            stop=tuple(self.stop or ()), seed=None if self.seed is None else self.seed + seed_offset,
            **settings(self, defaults))


_ID_OK = re.compile(r"^[^\x00-\x1f\x7f/]{1,256}$")


def settings(req: Any, defaults: SamplingDefaults) -> dict[str, Any]:
    """A request's temperature, top_p and top_k, each the model's recommended one (`defaults`, as
    vLLM applies a model's generation config) where the request names none: a stock client (the
    OpenAI SDKs, OpenClaw) sends none, and at temperature 1, uncut, a small model writes word salad."""
    return {"temperature": defaults.temperature if req.temperature is None else req.temperature,
            "top_p": defaults.top_p if req.top_p is None else req.top_p,
            "top_k": defaults.top_k if getattr(req, "top_k", None) is None else req.top_k}


def check_id(value: str, name: str) -> str:
    """A session or prompt id a client names (path or header): 1-256 characters, no control
    characters or slashes (they are stored, shown on the dashboard and used in paths)."""
    # fullmatch: `$` would let a final newline through. "." and "..": a link to such a session is
    # a dot segment, which browsers resolve away (its dashboard page could not be reached).
    if not _ID_OK.fullmatch(value) or value in (".", ".."):
        raise APIError(400, f"{name} must be 1-256 characters without control characters or '/', "
                            "and not '.' or '..'", param=name, code="invalid_value")
    return value


REQUEST_MODELS: dict[str, type[BaseModel]] = {}  # published in /openapi.json (`app.py`)


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that reads its body itself (to bound size and depth before
    parsing): the request schema FastAPI cannot see, by reference to the components."""
    REQUEST_MODELS[model.__name__] = model
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def openapi_components() -> dict[str, Any]:
    """The JSON schemas of every registered request model and the models they use."""
    out: dict[str, Any] = {}
    for name, model in REQUEST_MODELS.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(body.pop("$defs", {}))
        out[name] = body
    return out


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


def chunk(cid: str, model: str, version: int, created: int, delta: dict[str, Any], finish: str | None = None,
          logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """`created`: the stream's, in every chunk (OpenAI: "each chunk has the same timestamp")."""
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": fingerprint(version),
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


class CompletionRequest(BaseModel):
    """`POST /v1/completions`: a raw prompt (text or token ids) for white-box use, no chat template."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1, max_length=256)
    prompt: str | list[Annotated[int, Field(ge=0)]] | list[str] | list[list[Annotated[int, Field(ge=0)]]]
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS)  # OpenAI's default for this endpoint
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=1_000_000, description="vLLM's extension (0: all tokens)")
    stop: str | list[str] | None = Field(None, max_length=4)
    seed: int | None = SEED
    n: int = Field(1, ge=1, le=8)
    logprobs: int | None = Field(None, ge=0, le=0, description="only 0: the sampled token's logprob, no alternatives")
    echo: bool = Field(False, description="not supported: the prompt is never repeated in the text")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=4096)
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

    def sampling(self, defaults: SamplingDefaults, seed_offset: int = 0) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, stop=tuple(self.stop or ()),
                              seed=None if self.seed is None else self.seed + seed_offset, **settings(self, defaults))


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
