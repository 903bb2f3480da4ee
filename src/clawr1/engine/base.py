"""The engine contract that the gateway, the judge and the trainer use. Nothing else is public."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from clawr1.core.types import Generation, ParsedCompletion, SamplingDefaults, SamplingParams, TokenEvent


class GenerationStream(Protocol):
    """Tokens as they are sampled; `final()` drains the rest and returns the whole Generation.

    Optional: `ready() -> bool`, whether the next `__anext__` returns (or ends) without waiting.
    With it, a streamed reply sends the events that are ready together in one write (a burst from
    a remote engine, a loaded event loop) and waits on no timer for them; without it, each token
    is a write of its own. It must not say True when `__anext__` would wait."""

    # The policy version that samples it: an adapter's is fixed at submission; the base weights' is
    # settled when sampling begins (a request queued across a weights swap gets the new one).
    version: int

    def __aiter__(self) -> AsyncIterator[TokenEvent]: ...
    async def final(self) -> Generation: ...
    def cancel(self) -> None: ...


class Engine(Protocol):
    max_context: int
    tokenizer: Any  # a Hugging Face tokenizer: per-token text for logprobs
    sampling_defaults: SamplingDefaults  # the model's recommended sampling (its generation config)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]: ...
    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedCompletion:
        """A reply's content and tool calls (`tools`: the request's offered ones: `engine/chat.py`)."""
    def generate(self, prompt_ids: list[int], sampling: SamplingParams, adapter: str | None = None,
                 affinity: str | None = None) -> GenerationStream:
        """Start a generation (bad input raises here). `affinity`: requests with the same key (a
        session) should go where its prefix is cached; one engine has one place, replicas route by it."""
    async def score(self, prompt_ids: list[int], completion_ids: list[int], adapter: str | None = None,
                    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> list[float]:
        """Teacher-forced logprobs of the completion under the sampling distribution of these
        settings, each completion token kept in it (`engine/sampling.py`)."""
    async def load_adapter(self, name: str, path: Path) -> int: ...
    async def unload_adapter(self, name: str) -> None: ...
    def adapters(self) -> dict[str, int]: ...
    async def load_weights(self, path: Path) -> int:
        """Full fine-tuning: replace the base model's weights with a published version (between
        batches: requests running finish on the old weights, none fail); returns its version."""
    def weights_version(self) -> int:
        """The version of the base weights new requests get (0: as loaded)."""
    async def close(self) -> None: ...
