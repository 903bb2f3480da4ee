"""`ruff check` passes on the whole repository, with the rules written in `pyproject.toml`
(`[tool.ruff.lint]`): the ruff beside this interpreter, which `scripts/install.sh --test` installs
pinned. A finding fails the fast tier, so CI runs the lint with the tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.skip(f"ruff is not installed beside {sys.executable} (bash scripts/install.sh --test installs it)")
    done = subprocess.run([str(ruff), "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    version = subprocess.run([str(ruff), "--version"], capture_output=True, text=True, check=False).stdout.strip()
    assert done.returncode == 0, f"{version}:\n{done.stdout[-6000:]}{done.stderr[-2000:]}"
