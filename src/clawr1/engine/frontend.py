"""What an engine that does not hold the weights itself still owns: the model's tokenizer and chat
template (so prompt ids are rendered here and recorded exactly), its context window and end-of-turn
ids, and the checks a request gets before anything is sent. The remote engines (vLLM, SGLang) and
the Ray router are `Frontend`s, and so is the local engine, with the model in hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clawr1.core.types import ContextLengthError, InvalidRequestError, ParsedCompletion, SamplingDefaults
from clawr1.engine.chat import ChatFormat
from clawr1.engine.tokenizer import load_tokenizer


def model_json(model_path: Path, name: str) -> dict[str, Any]:
    path = Path(model_path) / name
    return json.loads(path.read_text()) if path.is_file() else {}


def sampling_defaults(generation: dict[str, Any]) -> SamplingDefaults:
    """A model's recommended sampling from its `generation_config.json`, as vLLM reads it (the
    temperature, top_k and top_p it names; `do_sample` is not consulted); what it leaves out, uncut
    at temperature 1 (OpenAI's defaults)."""
    top_k = int(generation.get("top_k") or 0)
    return SamplingDefaults(temperature=float(generation.get("temperature", 1.0)),
                            top_p=float(generation.get("top_p", 1.0)), top_k=max(top_k, 0))


def end_of_turn_ids(*given: int | list[int] | tuple[int, ...] | None) -> frozenset[int]:
    """The ids a reply ends on, from the tokenizer's and the generation config's `eos_token_id`
    (each an id, a list of ids or None): what the engines stop on and the trainer's stop term sums."""
    return frozenset(i for e in given for i in (e if isinstance(e, (list, tuple)) else [e]) if i is not None)


class Frontend:
    def __init__(self, model_path: Path, max_context: int = 0):
        """From the model directory's tokenizer and JSON files (the weights are elsewhere)."""
        generation = model_json(model_path, "generation_config.json")
        self.hold(load_tokenizer(model_path),
                  max_context or int(model_json(model_path, "config.json").get("max_position_embeddings", 2048)),
                  generation)

    def hold(self, tokenizer: Any, max_context: int, generation: dict[str, Any]) -> None:
        """What a frontend keeps: the tokenizer and its chat format, the context window, the
        end-of-turn ids (the tokenizer's, and the generation config's one or list) and the model's
        recommended sampling (`generation`: its `generation_config.json`). The local engine calls
        this with the tokenizer it loaded."""
        self.tokenizer, self.chat, self.max_context = tokenizer, ChatFormat(tokenizer), max_context
        self.eos_ids = end_of_turn_ids(tokenizer.eos_token_id, generation.get("eos_token_id"))
        self.sampling_defaults = sampling_defaults(generation)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.chat.render(messages, tools)

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedCompletion:
        return self.chat.parse(text, tools)

    def room(self, prompt_ids: list[int]) -> int:
        """Completion tokens that fit after the prompt; a prompt that leaves none is refused."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", "messages")
        room = self.max_context - len(prompt_ids)
        if room < 1:
            raise ContextLengthError(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is {self.max_context} "
                "and at least one completion token must fit", "messages")
        return room
