"""`SandboxEnv`: a tool env whose workspace is a fresh sandbox per episode (terminal, SWE).

Subclasses set `TOOLS` and write their `tool_*` methods and `outcome`; the workspace lifecycle
(reset writes the task's files, close releases the sandbox) lives here once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from clawr1.core.config import EnvsConfig
from clawr1.envs.base import Task
from clawr1.envs.sandbox import Sandbox
from clawr1.envs.tools import ToolEnv, write_files


class SandboxEnv(ToolEnv):
    TOOLS: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, config: EnvsConfig | None = None):
        self.config = config or EnvsConfig()
        self._sandbox: Sandbox | None = None
        self._task: Task | None = None

    def tools(self) -> list[dict[str, Any]]:
        return self.TOOLS

    def reset(self, task: Task) -> str:
        self.close()
        self._sandbox = Sandbox(limits=self.config)
        write_files(self._sandbox.workdir, task.files)
        self._task = task
        return task.prompt

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None

    @property
    def workdir(self) -> Path | None:
        return self._sandbox.workdir if self._sandbox else None

    def _started(self) -> tuple[Task, Sandbox]:
        """The episode's task and sandbox (outcome needs both)."""
        if self._task is None:
            raise RuntimeError("outcome() before reset()")
        return self._task, self._box()

    def _box(self) -> Sandbox:
        if self._sandbox is None:
            raise RuntimeError("the env has no workspace: call reset() first")
        return self._sandbox
