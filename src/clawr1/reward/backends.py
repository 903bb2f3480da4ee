"""Where the LLM judge's completions come from: the embedded engine (base weights) or any
OpenAI-compatible server. Both are `Complete` callables with an `aclose`."""

from __future__ import annotations

from typing import Any

import httpx

from clawr1.core.types import SamplingParams
from clawr1.engine.base import Engine
from clawr1.reward.types import Message


def _split_prefix(messages: list[Message]) -> tuple[list[Message], str]:
    """(the conversation, the answer prefix): a trailing assistant message is a prefix to continue."""
    if messages and messages[-1].get("role") == "assistant":
        return messages[:-1], str(messages[-1].get("content") or "")
    return messages, ""


class EngineBackend:
    """Completions from the serving engine with the adapter off (adapter=None = the base weights), so
    the judge does not drift with the policy it judges. Judge requests batch with serving traffic."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.name = "embedded"

    async def __call__(self, messages: list[Message], temperature: float, max_tokens: int) -> str:
        conversation, prefix = _split_prefix(messages)
        ids = self.engine.render(conversation)
        if prefix:  # continue the assistant's answer: the model's next tokens *are* the answer
            ids = ids + list(self.engine.tokenizer.encode(prefix, add_special_tokens=False))
        sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        generation = await self.engine.generate(ids, sampling, adapter=None).final()
        return prefix + generation.content

    async def aclose(self) -> None:
        """The engine belongs to its owner; nothing to close here."""


class OpenAIBackend:
    """Completions from an OpenAI-compatible `/chat/completions` (vLLM, SGLang, llama.cpp, OpenAI).

    An answer prefix is dropped: continuing an assistant message is not portable across servers,
    and the prompts also ask for the answer format in words, which capable models follow."""

    def __init__(self, url: str, api_key: str | None, model: str, timeout_s: float = 120.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self.model = model
        self.name = f"{model}@{self.url}"
        self._client = httpx.AsyncClient(headers=headers, timeout=timeout_s, transport=transport)

    async def __call__(self, messages: list[Message], temperature: float, max_tokens: int) -> str:
        conversation, _ = _split_prefix(messages)
        body: dict[str, Any] = {"model": self.model, "messages": conversation, "temperature": temperature,
                                "max_tokens": max_tokens}
        response = await self._client.post(f"{self.url}/chat/completions", json=body)
        response.raise_for_status()
        choices = response.json().get("choices") or []
        if not choices:
            raise ValueError(f"{self.url}/chat/completions answered without choices")
        return str(choices[0].get("message", {}).get("content") or "")

    async def aclose(self) -> None:
        await self._client.aclose()


def engine_backend(engine: Engine) -> EngineBackend:
    return EngineBackend(engine)


def openai_backend(url: str, api_key: str | None, model: str) -> OpenAIBackend:
    return OpenAIBackend(url, api_key, model)
