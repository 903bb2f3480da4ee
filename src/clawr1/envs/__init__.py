"""Agent environments shared by both offline modes: `terminal` (shell in a sandbox), `toolcall`
(in-process function tools) and `swe` (fix a bug until unit tests pass).

`make_env(task.env, config)` builds one episode's env; `builtin_tasks(name)` is the shipped task
set of an env (`data/<name>.jsonl`), read with `load_tasks`; `task_set(spec)` is what every
`--tasks`/`--heldout` flag means (families, a file, or a shipped set).
"""

from __future__ import annotations

from importlib import resources
from itertools import chain, zip_longest
from pathlib import Path

from clawr1.core.config import Config, EnvsConfig
from clawr1.envs.base import Env, Task, load_tasks

__all__ = ["Env", "Task", "builtin_tasks", "load_tasks", "make_env", "registry", "task_set"]


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


def task_set(spec: str, split: str | None = None, n: int | None = None, default_split: str = "train") -> list[Task]:
    """The tasks a `--tasks`/`--heldout` flag means, the one parser of such specs:
    - generated families: a name (`arithmetic`), `family:NAME:SPLIT`, several comma-separated, or
      `all`; each in `split`, else its spec's, else `default_split`; `n` per family; several are
      interleaved so every round of a run mixes them;
    - else a JSONL file of tasks, or a shipped set by its env name (`terminal`, `toolcall`, `swe`):
      its first `n`. They have no splits: a `split` for them is a ValueError, as is an unknown name.
    A missing file is a FileNotFoundError, not an unknown set."""
    if n is not None and n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    from clawr1.envs import families

    names = list(families.registry()) if spec == "all" else [part.strip() for part in spec.split(",")]
    picked = [families.parse_spec(name, default_split) or ((name, default_split) if name in families.registry() else None)
              for name in names]
    if all(picked):
        per = [families.generate(name, split or own, n) for name, own in picked]  # type: ignore[misc]
        return [task for task in chain.from_iterable(zip_longest(*per)) if task is not None]
    if len(names) > 1:
        unknown = [name for name, found in zip(names, picked, strict=True) if not found]
        raise ValueError(f"unknown task family {unknown}; known: {', '.join(families.registry())}, or 'all'")
    if split is not None:
        raise ValueError(f"a split applies to task families ({', '.join(families.registry())}), not to {spec!r}")
    if Path(spec).is_file() or spec.endswith(".jsonl") or "/" in spec:
        tasks = load_tasks(spec)
    else:
        tasks = load_tasks(builtin_tasks(spec))  # ValueError for an unknown set
    return tasks[:n] if n is not None else tasks
