"""A model directory's tokenizer, loaded once per process.

Loading SmolLM2's tokenizer parses a 1.5 MB tokenizer.json twice (Python's JSON, then the Rust
tokenizer's own): ~0.2 s each time. The engine, its front end, the trainer's policy and the Tinker
trainer each load the same directory's, so a process that runs several of them (or restarts one)
paid it every time. They share one instance now. That is safe because nothing here changes a
tokenizer after loading it: no added tokens, no template edits, and no padding or truncation. An
encode without them clears the fast backend's padding and truncation when a tokenizer.json sets
them, a write two threads could race on; `load_tokenizer` clears them once at load instead, so
every later encode only reads. The embedding model's tokenizer (`reward/embed.py`) pads and
truncates, so it keeps its own.

The key is the directory and the size and modification time of each file in it, so a tokenizer
rewritten in place is loaded again. A model id that is not a local directory is not cached.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

KEEP = 4
"""Tokenizers kept at most: the least recently used beyond it is dropped."""

_loaded: OrderedDict[tuple, Any] = OrderedDict()
_lock = threading.Lock()


def load_tokenizer(model_path: str | Path) -> Any:
    """`AutoTokenizer.from_pretrained(model_path)`, shared by every caller in this process while the
    directory's files stay as they are."""
    path = Path(model_path)
    if not path.is_dir():
        return AutoTokenizer.from_pretrained(model_path)
    with os.scandir(path) as entries:
        stats = [(e.name, e.stat()) for e in entries if e.is_file()]
    files = tuple(sorted((name, stat.st_size, stat.st_mtime_ns) for name, stat in stats))
    key = (str(path.resolve()), files)
    with _lock:  # two threads loading one directory at once load it once
        if key in _loaded:
            _loaded.move_to_end(key)
            return _loaded[key]
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            backend.no_padding()
            backend.no_truncation()
        _loaded[key] = tokenizer
        while len(_loaded) > KEEP:
            _loaded.popitem(last=False)
        return tokenizer
