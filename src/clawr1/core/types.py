"""Value types that cross role boundaries: sampling parameters, generations, tool calls, errors.
The pool's records (Step, Sample, ...) are in `records.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "tool_calls", "aborted"]


class EngineError(Exception):
    """Base of every error the engine raises on bad input; carries OpenAI's `code` and `param`.

    The gateway turns these into `{"error": {"message", "type", "param", "code"}}` responses.
    """

    status = 400
    code = "invalid_request"
    type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(EngineError):
    """A malformed request: empty prompt, max_tokens <= 0, temperature out of range, ..."""


class ContextLengthError(EngineError):
    """The prompt does not fit the model's context window (OpenAI: `context_length_exceeded`)."""

    code = "context_length_exceeded"


class UnknownAdapterError(EngineError):
    """A request named an adapter that is not loaded."""

    status = 404
    code = "model_not_found"


class AdapterError(EngineError):
    """An adapter directory is incomplete (no marker) or not a LoRA adapter for this model."""

    code = "adapter_invalid"


class EngineOverloadedError(EngineError):
    """The engine's wait queue is full; retry later (HTTP 429)."""

    status = 429
    code = "engine_overloaded"
    type = "rate_limit_error"


class EngineFailure(EngineError):
    """The engine failed while running a request (HTTP 502); the request's input was fine."""

    status = 502
    code = "engine_failure"
    type = "server_error"


MAX_STOP_CHARS = 1024  # a stop sequence's length limit (OpenAI's API states none; agents' are a few characters)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion. Validated on construction.

    `temperature == 0` is greedy decoding; returned logprobs are then those of the unscaled
    distribution (temperature 1). Otherwise logprobs are of the distribution actually sampled
    from: temperature-scaled, cut to the `top_k` most likely tokens (0: all) and then to the `top_p`
    nucleus, renormalised (`engine/sampling.py`), so `score` with the same settings reproduces
    them exactly and the trainer's importance ratio compares like with like.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_k: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError(f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= 1_000_000:
            raise InvalidRequestError(f"top_k must be an integer in [0, 1000000] (0: off), got {self.top_k!r}", "top_k")
        if len(self.stop) > 4 or any(not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            # Long ones are refused: text that could begin one is held back and re-checked each token.
            raise InvalidRequestError(f"stop takes at most 4 non-empty strings of at most {MAX_STOP_CHARS} characters",
                                      "stop")

    @property
    def recorded(self) -> dict[str, Any]:
        """What a Generation records of its sampling, the settings `score` must use to reproduce its
        logprobs: the temperature (1 for greedy: its logprobs are of the unscaled distribution) and
        the cut (none for greedy)."""
        if self.temperature > 0:
            return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}
        return {"temperature": 1.0, "top_k": 0, "top_p": 1.0}


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that names no sampling settings gets: the model's recommended ones (its
    `generation_config.json`, as vLLM applies them), or the config's (`engine.temperature` ...)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def overridden(self, temperature: float | None, top_p: float | None, top_k: int | None) -> SamplingDefaults:
        """These defaults with each setting that is not None in its place (config over the model's)."""
        return SamplingDefaults(self.temperature if temperature is None else temperature,
                                self.top_p if top_p is None else top_p, self.top_k if top_k is None else top_k)


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token as it streams out. `text` is the newly visible text (may be empty while
    a multi-byte character or a possible stop sequence is still incomplete)."""

    token_id: int
    logprob: float
    text: str


@dataclass(frozen=True)
class ToolCall:
    """An OpenAI-style function call; `arguments` is a JSON string, as OpenAI sends it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedCompletion:
    """A completion split into visible content and tool calls."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass
class Generation:
    """The exact result of one generation: what the trainer will learn from.

    `token_ids` are the sampled ids (including a final end-of-turn token, which the model must
    learn to emit); `logprobs[i]` is the logprob of `token_ids[i]`; `text` is `token_ids` decoded
    without special tokens, so the capture is token-faithful. `content` is `text` cut at a matched
    stop sequence, which OpenAI does not return.
    """

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    adapter: str | None = None
    version: int = 0
    stop_match: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0  # with `top_k`, the cut of the distribution the logprobs are of (see SamplingParams)
    top_k: int = 0

    @property
    def content(self) -> str:
        if self.stop_match is None:
            return self.text
        return self.text[: self.text.find(self.stop_match)]
