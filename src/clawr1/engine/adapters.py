"""The version store: versioned LoRA (or whole-weight) directories, published atomically, with the
guard's verdicts, the admin's controls and a retention rule. Whoever is on either side (the trainer
publishing; a gateway, vLLM, SGLang or Ray replicas loading) goes through these functions.

Layout of `<root>/<name>/`:
- `v000007/`: peft's `adapter_config.json` and `adapter_model.safetensors`, and last a marker
  `STABLE` with `{"name", "version", "rollback"}` (`rollback`: the id of the newest rollback the
  trainer had applied when it trained this version, so a version trained on a line an admin or the
  guard rolled back meanwhile is never served). A writer syncs every file before it writes the marker, and
  writes the marker itself as every JSON file here (below), so it is never seen empty or cut; a
  reader loads only marked directories, so a crash mid-write can never be served (a publisher
  SIGKILLed after every file boundary and at random moments: `tests/unit/test_faults.py`);
- `v000007/VERDICT`: the guard's decision on that candidate (`promoted` / `rejected`, why, scores);
- `LATEST`: the newest marked version's number, replaced atomically after its marker, so a watcher
  reads one small file instead of listing the directory;
- `CONTROL`: the admin's `pinned` version and `rollback` request.
Every JSON file is written to a temporary name, synced and renamed: a reader sees all or nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from clawr1.core.types import AdapterError

MARKER = "STABLE"
REMOTE = "remote.json"  # a version trained on a service: where its sampler is (`publish_remote`)
VERDICT, LATEST, CONTROL = "VERDICT", "LATEST", "CONTROL"
_VERSION_DIR = re.compile(r"^v(\d+)$")


def version_dir(root: Path, name: str, version: int) -> Path:
    return Path(root) / name / f"v{version:06d}"


def read_marker(path: Path) -> dict[str, Any]:
    """The marker of a complete adapter directory; AdapterError if the directory is incomplete."""
    marker = Path(path) / MARKER
    if not marker.is_file():
        raise AdapterError(f"adapter directory {path} is incomplete (no {MARKER} marker); not loading it")
    content = _marker_json(marker)
    files = (REMOTE,) if content.get("kind") == "remote" else ("adapter_config.json", "adapter_model.safetensors")
    for required in files:
        if not (Path(path) / required).is_file():
            raise AdapterError(f"adapter directory {path} lacks {required}")
    return content


def _marker_json(marker: Path) -> dict[str, Any]:
    """A marker's content. One cut by a crash (written in place by clawr1 before markers were
    replaced atomically: SIGKILL between its open and its write left it empty) is an incomplete
    directory, refused as one: a `JSONDecodeError` would end the gateway's version watcher."""
    try:
        return json.loads(marker.read_text())
    except ValueError as exc:
        raise AdapterError(f"{marker} is not a complete marker ({exc}); not loading {marker.parent}") from exc


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(peft_model: Any, root: Path, name: str, version: int, rollback: str | None = None) -> Path:
    """Write adapter `name` of a peft model as version `version`: files, fsync, then the marker.
    `rollback`: the newest rollback id the trainer applied before training it (see the layout)."""
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
    _fsync(target)  # the files' names too, before the marker can exist
    # Atomically: written in place, a kill between the marker's open and its write left an empty
    # STABLE that `latest()` took for a complete version and `read_marker` could not parse.
    write_json(target / MARKER, {"name": name, "version": version, "rollback": rollback})
    write_json(Path(root) / name / LATEST, {"version": version})
    return target


def trained_before_rollback(path: Path, control: dict[str, Any]) -> str | None:
    """Why the version at `path` must not serve: it was trained before the rollback in `control`
    (the adapter's `CONTROL`) was applied, on the line that rollback discarded; None when it may
    (no rollback asked, or a marker from before markers carried the field)."""
    request = control.get("rollback")
    marker = read_marker(path)
    if not request or "rollback" not in marker or marker["rollback"] == request["id"]:
        return None
    return f"trained before the rollback to v{request['to']} was applied (on the line it discarded)"


def publish_remote(root: Path, name: str, version: int, remote: dict[str, Any], rollback: str | None = None) -> Path:
    """A version whose weights live on a training service (`trainer.backend = "tinker"`): its
    directory holds `remote.json` (where the service keeps the sampler), then the marker."""
    target = version_dir(root, name, version)
    if (target / MARKER).exists():
        raise AdapterError(f"adapter {name} v{version} already published at {target}")
    target.mkdir(parents=True, exist_ok=True)
    write_json(target / REMOTE, remote)
    write_json(target / MARKER, {"name": name, "version": version, "kind": "remote", "rollback": rollback})
    write_json(Path(root) / name / LATEST, {"version": version})
    return target


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Replace `path` atomically: a temporary file, synced, renamed, then the directory synced.
    The temporary file is this writer's own (process and thread): two writers of one file (the
    guard, the dashboard, `clawr1 pin`) must never write into, or rename, each other's."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data))
    _fsync(tmp)
    tmp.replace(path)
    _fsync(path.parent)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def newest(root: Path, name: str) -> tuple[int, Path] | None:
    """The newest published version (one file read: `LATEST`); stores written before the pointer
    existed are listed once (`latest`)."""
    pointer = read_json(Path(root) / name / LATEST)
    if pointer is None:
        return latest(root, name)
    path = version_dir(root, name, int(pointer["version"]))
    return (int(pointer["version"]), path) if (path / MARKER).is_file() else latest(root, name)


def verdict(root: Path, name: str, version: int) -> dict[str, Any] | None:
    """The guard's decision on a version: `{"status", "reason", "scores", "decided_at"}`, or None."""
    return read_json(version_dir(root, name, version) / VERDICT)


def decide(root: Path, name: str, version: int, status: str, reason: str, scores: dict[str, Any]) -> None:
    write_json(version_dir(root, name, version) / VERDICT,
               {"status": status, "reason": reason, "scores": scores, "decided_at": time.time()})


def control(root: Path, name: str) -> dict[str, Any]:
    """The admin's controls: `pinned` (a version to serve whatever else is promoted, or None) and
    `rollback` (`{"to": N, "id": ...}`: serve N and train on from it; the trainer keeps the ids it
    applied)."""
    return read_json(Path(root) / name / CONTROL) or {"pinned": None, "rollback": None}


def serve_order(root: Path, name: str) -> list[int]:
    """What may serve `name`, best first, the one rule for every serving side (the gateway's guard,
    a restarted Ray engine replica): the pinned version (the admin's choice, whatever its verdict),
    then the promoted ones newest first, then the base (0); never a rejected, superseded or
    undecided version unless pinned. A side that cannot load one serves the next."""
    pinned = control(root, name).get("pinned")
    head = [int(pinned)] if pinned is not None else []
    promoted = sorted((v for v in published(root, name) if (verdict(root, name, v) or {}).get("status") == "promoted"),
                      reverse=True)
    return head + [v for v in promoted if v not in head] + ([0] if 0 not in head else [])


def to_serve(root: Path, name: str) -> int:
    """What serves `name` on a (re)start when it loads (`serve_order`'s first)."""
    return serve_order(root, name)[0]


def set_control(root: Path, name: str, **changes: Any) -> dict[str, Any]:
    """Change some of the controls and keep the others. Read, merged and replaced under an
    exclusive lock on the adapter's folder: the guard (a rollback), the dashboard and `clawr1 pin`
    / `rollback` (other processes) may each change a field at once, and none may undo another's."""
    folder = Path(root) / name
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".CONTROL.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        current = {**control(root, name), **changes}
        write_json(folder / CONTROL, current)
    return current


def published(root: Path, name: str) -> list[int]:
    """Every complete version on disk, oldest first."""
    folder = Path(root) / name
    if not folder.is_dir():
        return []
    found = (_VERSION_DIR.match(child.name) for child in folder.iterdir())
    return sorted(int(m.group(1)) for m in found if m and (version_dir(root, name, int(m.group(1))) / MARKER).is_file())


def describe(root: Path, name: str) -> list[dict[str, Any]]:
    """Every version on disk with its verdict and probe scores, oldest first (`clawr1 versions`,
    the dashboard)."""
    pinned = control(root, name).get("pinned")
    rows = []
    for version in published(root, name):
        decided = verdict(root, name, version) or {}
        probe = (decided.get("scores") or {}).get("candidate") or {}
        rows.append({"version": version, "status": decided.get("status", "undecided"),
                     "reason": decided.get("reason", ""), "decided_at": decided.get("decided_at"),
                     **{k: probe.get(k) for k in ("sane_rate", "relevance", "fluency", "repetition", "kl", "entropy")},
                     "pinned": pinned == version})
    return rows


def prune(root: Path, name: str, keep: int, protect: set[int]) -> list[int]:
    """Remove all but the newest `keep` versions, sparing `protect` (the served one, a pinned one, a
    rollback target); returns what was removed. The marker goes first, so a half-removed directory
    is never loadable."""
    versions = published(root, name)
    removed = [v for v in versions[:-keep] if v not in protect] if keep > 0 else []
    for version in removed:
        path = version_dir(root, name, version)
        (path / MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return removed


def latest(root: Path, name: str) -> tuple[int, Path] | None:
    """The newest complete version of adapter `name`, if any (lists the directory)."""
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


def publish_weights(model: Any, root: Path, name: str, version: int, keep: int = 2,
                    state_dict: dict[str, Any] | None = None, rollback: str | None = None, dtype: Any = None) -> Path:
    """Full fine-tuning: write a whole model (`config.json`, `model.safetensors`) as version
    `version` of `name`, synced, then its marker; versions older than the newest `keep` are
    removed (an engine holds loaded weights in memory; a restarting one takes the newest).
    `state_dict`: the whole weights gathered from sharded trainer ranks, written in place of
    `model`'s own (which hold only this rank's shards). `dtype` (a torch dtype): the floating
    tensors written in it (mixed precision trains float32 master weights; the engine serves the
    compute dtype, and a float32 file would be twice the size)."""
    target = version_dir(root, name, version)
    if (target / MARKER).exists():
        raise AdapterError(f"weights {name} v{version} already published at {target}")
    target.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v
                      for k, v in (state_dict if state_dict is not None else model.state_dict()).items()}
    model.save_pretrained(target, safe_serialization=True, state_dict=state_dict)
    for file in target.iterdir():
        _fsync(file)
    _fsync(target)
    write_json(target / MARKER, {"name": name, "version": version, "kind": "weights", "rollback": rollback})
    write_json(Path(root) / name / LATEST, {"version": version})
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
    return _marker_json(marker)
