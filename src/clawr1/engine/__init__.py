"""Serving a model: chat template -> prompt ids, generation with sampled ids + logprobs, scoring,
LoRA adapters by name with atomic version swaps. `Engine` is the whole contract; the local engine,
vLLM and SGLang stand behind it (`engine.backend`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clawr1.core.config import Config
from clawr1.engine.base import Engine, GenerationStream
from clawr1.engine.models import resolve_model


def __getattr__(name: str) -> Any:
    """`LocalEngine` on first use: importing it imports torch and transformers (seconds), which a
    CLI command that only reads the adapter store (`clawr1 versions`) should not pay."""
    if name == "LocalEngine":
        from clawr1.engine.local import LocalEngine

        return LocalEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_engine(config: Config) -> Engine:
    """The engine `config.engine.backend` names, for `config.engine.model` (the embedded model is
    converted on first use; a remote engine reads only its tokenizer and chat template)."""
    path: Path = resolve_model(config.engine.model, config.data_dir)
    backend = config.engine.backend
    if backend == "local":
        from clawr1.engine.local import LocalEngine

        return LocalEngine.load(path, config.engine)
    if backend == "tinker":
        from clawr1.engine.tinker import TinkerEngine

        return TinkerEngine(path, config)
    if not config.engine.url:
        raise ValueError(f'engine.backend = "{backend}" needs engine.url (the server\'s base URL)')
    if backend == "vllm":
        from clawr1.engine.vllm import VLLMEngine

        return VLLMEngine(path, config.engine)
    from clawr1.engine.sglang import SGLangEngine

    return SGLangEngine(path, config.engine)


__all__ = ["Engine", "GenerationStream", "LocalEngine", "load_engine"]
