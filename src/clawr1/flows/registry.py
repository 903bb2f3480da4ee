"""Flows by name: a flow on the command line is a registered name (`tool-agent`),
`package.module:Class`, or `path/to/file.py:Class`. Apart from `base`, so that the contract
imports no flow and a flow module may import the contract."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from clawr1.flows.base import AgentFlow
from clawr1.flows.tool_agent import ToolAgentFlow


def registry() -> dict[str, type[AgentFlow]]:
    """The built-in flows by name."""
    return {ToolAgentFlow.name: ToolAgentFlow}


def load_flow(spec: str) -> type[AgentFlow]:
    """A flow class from a registered name, `module:Class` or `path/to/file.py:Class`.

    Raises:
        ValueError: an unknown name, or a spec of neither form.
        TypeError: the spec names something that is not an AgentFlow subclass.
        ImportError, FileNotFoundError: the module or file cannot be loaded.
    """
    builtin = registry()
    if spec in builtin:
        return builtin[spec]
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(f"unknown flow {spec!r}: use one of {sorted(builtin)}, module:Class or path/to/file.py:Class")
    module = _load_file(Path(where)) if where.endswith(".py") else importlib.import_module(where)
    cls: Any = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, AgentFlow)):
        raise TypeError(f"{spec!r}: {attr} is not an AgentFlow subclass in {where}")
    return cls


def _load_file(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"flow file {path} does not exist")
    name = f"clawr1_flow_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look classes up by module name
    spec.loader.exec_module(module)
    return module
