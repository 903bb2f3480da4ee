"""Real JavaScript clients from the npm registry, installed once per machine into a cache folder.

A test that needs npm is skipped, with the reason, only when `npm` itself is missing; a failed
install fails the test (the registry is one this project's machines reach)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("CLAWR1_NPM_CACHE", Path.home() / ".cache" / "clawr1-tests" / "npm"))


def npm_install(name: str, *packages: str, node: Path | None = None, timeout: float = 600) -> Path:
    """`npm install packages` into `CACHE/name` unless the same packages are there already; with
    `node` (a folder holding a `node` binary) first on PATH, for packages whose install scripts
    check the Node version."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the real JavaScript clients (OpenClaw, the OpenAI Node SDK) need it")
    folder = CACHE / name
    marker = folder / ".clawr1-installed"
    spec = " ".join(packages)
    folder.mkdir(parents=True, exist_ok=True)
    # One install per folder at a time: two pytest-xdist workers both need Node, and two `npm
    # install`s into one prefix at once leave it broken.
    with open(CACHE / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file() and marker.read_text() == spec:
            return folder
        env = {**os.environ, "PATH": f"{node}{os.pathsep}{os.environ['PATH']}"} if node else None
        done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(folder), *packages],
                              check=False, capture_output=True, text=True, timeout=timeout, env=env)
        assert done.returncode == 0, f"npm install {spec} failed:\n{done.stderr[-3000:]}"
        marker.write_text(spec)
    return folder


def node_bin(version: str = "24.21.0") -> Path:
    """A folder with Node `version` in it, from the npm package `node` (the machine's may be older)."""
    return npm_install(f"node-{version}", f"node@{version}") / "node_modules" / "node" / "bin"
