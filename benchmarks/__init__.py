"""Benchmarks that measure Claw-R1 against a plain baseline in one run and print the ratios
(`clawr1 bench engine|gateway|pool|judge|judge-tools|trainer|swap|latency|scale|crash`).

They live beside `src/`, not in the installed package: `clawr1 bench ...` runs them from a checkout
(the editable install the README's command makes). Servers they start are child processes that
import `benchmarks.*` too, so `child_env` puts the checkout on their `PYTHONPATH`.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout: benchmarks/, src/, tests/


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child that runs `python -m benchmarks.<name>`, whatever
    its working directory."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""), **(extra or {})}
