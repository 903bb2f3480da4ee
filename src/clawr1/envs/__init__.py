"""Agent environments shared by both offline modes: `terminal` (shell in a sandbox), `toolcall`
(in-process function tools) and `swe` (fix a bug until unit tests pass).

`make_env(task.env, config)` builds one episode's env; `builtin_tasks(name)` is the shipped task
set of an env (`data/<name>.jsonl`), read with `load_tasks`.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from clawr1.core.config import Config, EnvsConfig
from clawr1.envs.base import Env, Task, load_tasks

__all__ = ["Env", "Task", "builtin_tasks", "load_tasks", "make_env", "registry"]


def registry() -> dict[str, type[Env]]:
    """The environments by name (imported here so that importing `clawr1.envs` stays cheap)."""
    from clawr1.envs.swe import SWEEnv
    from clawr1.envs.terminal import TerminalEnv
    from clawr1.envs.toolcall import ToolCallEnv

    return {cls.name: cls for cls in (TerminalEnv, ToolCallEnv, SWEEnv)}


def make_env(name: str, config: EnvsConfig | Config | None = None) -> Env:
    """A fresh env named `name`. `config` is the `envs` section, or a whole `Config` (the flows
    pass theirs). Raises ValueError for an unknown name."""
    envs = registry()
    if name not in envs:
        raise ValueError(f"unknown env {name!r}; known: {', '.join(sorted(envs))}")
    section = config.envs if isinstance(config, Config) else config
    return envs[name](section)  # type: ignore[call-arg]


def builtin_tasks(name: str) -> Path:
    """The shipped task file of env `name` (a JSONL of `Task`s)."""
    path = Path(str(resources.files("clawr1.envs").joinpath("data", f"{name}.jsonl")))
    if not path.is_file():
        raise ValueError(f"no built-in tasks for env {name!r} (looked for {path})")
    return path
