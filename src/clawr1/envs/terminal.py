"""`terminal`: one tool, `run`, a shell command in a sandboxed workspace.

The tool message is the command's exit code and the heads of its stdout and stderr: that is the
next state the judge reads. The outcome is the task's checker over the workspace (see `checks`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clawr1.core.config import EnvsConfig
from clawr1.envs.base import Task
from clawr1.envs.checks import CheckContext, check
from clawr1.envs.sandbox import Sandbox
from clawr1.envs.tools import ToolEnv, function_tool, write_files

_TOOLS = [function_tool(
    "run", "Run one shell command (sh) in the task's directory and get its exit code and output. "
    "There is no network; files outside the task's directory are read-only.",
    {"command": {"type": "string", "description": "The shell command, e.g. `ls -l` or `echo hi > a.txt`.",
                 "maxLength": 20_000}},
    ["command"])]


class TerminalEnv(ToolEnv):
    name = "terminal"
    system = ("You are an agent working in a Linux shell. To act, call the `run` tool with a shell command; "
              "its reply is the exit code and the output. Work in the current directory. When the task is "
              "done, reply with a short final answer and no tool call.")

    def __init__(self, config: EnvsConfig | None = None):
        self.config = config or EnvsConfig()
        self._sandbox: Sandbox | None = None
        self._task: Task | None = None

    def tools(self) -> list[dict[str, Any]]:
        return _TOOLS

    def reset(self, task: Task) -> str:
        self.close()
        self._sandbox = Sandbox(limits=self.config)
        write_files(self._sandbox.workdir, task.files)
        self._task = task
        return task.prompt

    def tool_run(self, command: str) -> str:
        return self._box().run(command).message()

    def outcome(self, final_answer: str | None = None) -> float:
        if self._task is None:
            raise RuntimeError("outcome() before reset()")
        box = self._box()
        ctx = CheckContext(workdir=box.workdir, run=box.run, final_answer=final_answer)
        return 1.0 if check(self._task.check, ctx) else -1.0

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None

    @property
    def workdir(self) -> Path | None:
        return self._sandbox.workdir if self._sandbox else None

    def _box(self) -> Sandbox:
        if self._sandbox is None:
            raise RuntimeError("the env has no workspace: call reset() first")
        return self._sandbox
