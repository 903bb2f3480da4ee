"""`terminal`: one tool, `run`, a shell command in a sandboxed workspace.

The tool message is the command's exit code and the heads of its stdout and stderr: that is the
next state the judge reads. The outcome is the task's checker over the workspace (see `checks`).
"""

from __future__ import annotations

import re

from clawr1.envs.checks import CheckContext, check
from clawr1.envs.sandboxed import SandboxEnv
from clawr1.envs.tools import function_tool

_EXIT = re.compile(r"exit code: (-?\d+)")  # the first line of `SandboxResult.message`
_TOOLS = [function_tool(
    "run", "Run one shell command (sh) in the task's directory and get its exit code and output. "
    "There is no network; files outside the task's directory are read-only.",
    {"command": {"type": "string", "description": "The shell command, e.g. `ls -l` or `echo hi > a.txt`.",
                 "maxLength": 20_000}},
    ["command"])]


class TerminalEnv(SandboxEnv):
    name = "terminal"
    TOOLS = _TOOLS
    system = ("You are an agent working in a Linux shell. To act, call the `run` tool with a shell command; "
              "its reply is the exit code and the output. Work in the current directory. When the task is "
              "done, reply with a short final answer and no tool call.")

    def tool_run(self, command: str) -> str:
        return self._box().run(command).message()

    def failed(self, message: str) -> bool:
        """Bad arguments ("Error: ..."), or a command that exited non-zero or was killed."""
        exit_code = _EXIT.match(message)
        return super().failed(message) or (exit_code is not None and int(exit_code.group(1)) != 0) \
            or "\nkilled:" in message

    def outcome(self, final_answer: str | None = None) -> float:
        task, box = self._started()
        ctx = CheckContext(workdir=box.workdir, run=box.run, final_answer=final_answer)
        return 1.0 if check(task.check, ctx) else -1.0
