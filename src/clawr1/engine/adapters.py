"""The adapter store: versioned LoRA directories, published atomically.

Layout: `<root>/<name>/v000007/` holding peft's `adapter_config.json` and
`adapter_model.safetensors`, and last a marker `STABLE` with `{"name", "version"}`. A writer
syncs every file before it writes the marker; a reader loads only marked directories, so a
crash mid-write can never be served.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from clawr1.core.types import AdapterError

MARKER = "STABLE"
_VERSION_DIR = re.compile(r"^v(\d+)$")


def version_dir(root: Path, name: str, version: int) -> Path:
    return Path(root) / name / f"v{version:06d}"


def read_marker(path: Path) -> dict[str, Any]:
    """The marker of a complete adapter directory; AdapterError if the directory is incomplete."""
    marker = Path(path) / MARKER
    if not marker.is_file():
        raise AdapterError(f"adapter directory {path} is incomplete (no {MARKER} marker); not loading it")
    for required in ("adapter_config.json", "adapter_model.safetensors"):
        if not (Path(path) / required).is_file():
            raise AdapterError(f"adapter directory {path} lacks {required}")
    return json.loads(marker.read_text())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(peft_model: Any, root: Path, name: str, version: int) -> Path:
    """Write adapter `name` of a peft model as version `version`: files, fsync, then the marker."""
    target = version_dir(root, name, version)
    if (target / MARKER).exists():
        raise AdapterError(f"adapter {name} v{version} already published at {target}")
    target.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(target, selected_adapters=[name] if name in peft_model.peft_config else None)
    # peft nests non-default adapters in a sub-folder; flatten so every version looks the same.
    nested = target / name
    if nested.is_dir():
        for file in nested.iterdir():
            file.replace(target / file.name)
        nested.rmdir()
    for file in target.iterdir():
        _fsync(file)
    (target / MARKER).write_text(json.dumps({"name": name, "version": version}))
    _fsync(target / MARKER)
    _fsync(target)
    return target


def latest(root: Path, name: str) -> tuple[int, Path] | None:
    """The newest complete version of adapter `name`, if any."""
    best: tuple[int, Path] | None = None
    folder = Path(root) / name
    if not folder.is_dir():
        return None
    for child in folder.iterdir():
        match = _VERSION_DIR.match(child.name)
        if match and (child / MARKER).is_file():
            version = int(match.group(1))
            if best is None or version > best[0]:
                best = (version, child)
    return best


WEIGHT_FILES = ("config.json", "model.safetensors")


def publish_weights(model: Any, root: Path, name: str, version: int, keep: int = 2) -> Path:
    """Full fine-tuning: write a whole model (`config.json`, `model.safetensors`) as version
    `version` of `name`, synced, then its marker; versions older than the newest `keep` are
    removed (an engine holds loaded weights in memory; a restarting one takes the newest)."""
    target = version_dir(root, name, version)
    if (target / MARKER).exists():
        raise AdapterError(f"weights {name} v{version} already published at {target}")
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    for file in target.iterdir():
        _fsync(file)
    (target / MARKER).write_text(json.dumps({"name": name, "version": version, "kind": "weights"}))
    _fsync(target / MARKER)
    _fsync(target)
    for child in sorted((Path(root) / name).iterdir()):
        match = _VERSION_DIR.match(child.name)
        if match and int(match.group(1)) <= version - keep:
            shutil.rmtree(child, ignore_errors=True)
    return target


def read_weights_marker(path: Path) -> dict[str, Any]:
    """The marker of a complete weights directory; AdapterError if it is incomplete."""
    marker = Path(path) / MARKER
    if not marker.is_file() or not all((Path(path) / f).is_file() for f in WEIGHT_FILES):
        raise AdapterError(f"weights directory {path} is incomplete (no {MARKER} marker or files); not loading it")
    return json.loads(marker.read_text())
