"""The white-box flow contract: an `AgentFlow` runs one task with an OpenAI-compatible client and
returns the outcome.

The client's base URL already carries `/{session_id}/{prompt_id}/v1`, so every call the flow
makes is recorded as the next turn of its own session, and the G rollouts of one task share a
prompt id (their GRPO group). The flow never talks to the pool or the trainer: it is an agent like
any other, which is why the same flow also runs against a remote gateway.

A flow on the command line is a registered name (`tool-agent`), `package.module:Class`, or
`path/to/file.py:Class`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clawr1.core.config import Config
from clawr1.envs.base import Task

if TYPE_CHECKING:
    import openai


class AgentFlow(ABC):
    """One agent program. `run` is called from several threads at once (one per rollout), so it
    keeps per-rollout state in locals, not on `self`."""

    #: Registry name (for the built-in flows).
    name: str = ""

    def __init__(self, config: Config | None = None):
        self.config = config or Config()

    @abstractmethod
    def run(self, task: Task, client: openai.OpenAI) -> float | None:
        """Solve `task` with `client` (every call is recorded into this rollout's session).

        Returns:
            The outcome in [-1, 1] (1 solved, -1 not), or None when the flow cannot tell; the
            session then closes without a reward and its last turn is masked.
        """


def registry() -> dict[str, type[AgentFlow]]:
    """The built-in flows by name (imported here, so a flow module may import this one)."""
    from clawr1.flows.tool_agent import ToolAgentFlow

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
