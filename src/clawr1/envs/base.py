"""The environment contract shared by both offline modes (white-box flows and black-box agents).

A task is one line of a JSONL file. An `Env` is one episode of one task: it sets up a workspace,
executes the agent's tool calls (never raising on bad arguments: the error text comes back as the
tool message, which is the next state the judge sees), and checks the outcome at the end.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self


@dataclass(frozen=True)
class Task:
    """One task. `env` names the environment; `prompt` is the instruction the agent gets as its
    first user message; `files` are written into the workspace before the agent starts; `check`
    is the checker's spec (env-specific, e.g. {"type": "file_equals", "path": ..., "text": ...});
    `tools` names the env's tools the task offers (None: all of them). An agent's prompt carries
    every offered tool's schema: offering a calculator task six tools made its first prompt 737 tokens
    on Qwen, ~95% of what a training step computes on."""

    id: str
    env: str
    prompt: str
    files: dict[str, str] = field(default_factory=dict)
    check: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    tools: tuple[str, ...] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        tools = d.get("tools")
        if tools is not None and (not isinstance(tools, list | tuple) or not tools
                                  or not all(isinstance(t, str) and t for t in tools)):
            raise ValueError(f"task {d.get('id')!r}: tools must be a non-empty list of tool names, got {tools!r}")
        return cls(id=str(d["id"]), env=str(d["env"]), prompt=str(d["prompt"]), files=dict(d.get("files", {})),
                   check=dict(d.get("check", {})), meta=dict(d.get("meta", {})),
                   tools=None if tools is None else tuple(tools))


def load_tasks(path: Path | str) -> list[Task]:
    """Tasks from a JSONL file (one JSON object per line; blank lines skipped)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [Task.from_dict(json.loads(line)) for line in lines if line.strip()]


class Env(ABC):
    """One episode: `reset` -> (`call` ...) -> `outcome` -> `close`. Not thread-safe; one per rollout."""

    #: Registry name, as in a task's `env` field.
    name: str = ""
    #: The system prompt that describes the environment and its tools to the agent (read after
    #: `reset`: it may describe only the tools the task offers).
    system: str = ""

    @abstractmethod
    def tools(self) -> list[dict[str, Any]]:
        """OpenAI function tools: [{"type": "function", "function": {"name", "description", "parameters"}}]."""

    @abstractmethod
    def reset(self, task: Task) -> str:
        """Set up the workspace for `task`; return the first user message."""

    @abstractmethod
    def call(self, name: str, arguments: str | dict[str, Any]) -> str:
        """Execute one tool call; return the tool message. Bad names or arguments return an error
        message (starting with "Error:"), never raise."""

    @abstractmethod
    def outcome(self, final_answer: str | None = None) -> float:
        """The task's checker: 1.0 solved, -1.0 not (values in between allowed)."""

    def failed(self, message: str) -> bool:
        """Whether a tool message (what `call` returned) reports a failed call: an "Error: ..." by
        default; envs whose tools report failure otherwise (an exit code) say so."""
        return message.startswith("Error")

    def close(self) -> None:  # noqa: B027 - a no-op unless the env holds a workspace: not abstract
        """Release the workspace."""

    @property
    def workdir(self) -> Path | None:
        """The episode's workspace directory, for envs that have one."""
        return None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
