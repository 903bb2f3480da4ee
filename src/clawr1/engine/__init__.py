"""Serving a model: chat template -> prompt ids, generation with sampled ids + logprobs, scoring,
LoRA adapters by name with atomic version swaps. `Engine` is the whole contract."""

from __future__ import annotations

from pathlib import Path

from clawr1.core.config import Config
from clawr1.engine.base import Engine, GenerationStream
from clawr1.engine.local import LocalEngine
from clawr1.engine.models import resolve_model


def load_engine(config: Config) -> LocalEngine:
    """The local engine for `config.engine.model` (converting the embedded model on first use)."""
    path: Path = resolve_model(config.engine.model, config.data_dir)
    return LocalEngine.load(path, config.engine)


__all__ = ["Engine", "GenerationStream", "LocalEngine", "load_engine"]
