"""Task families: tasks generated from templates and seeds, with a held-out split.

A family turns (seed, split, level) into one `Task` whose `meta` carries its reference solution
(`solution`: the tool calls and the final answer that solve it), so a test replays every
generated task against its checker. The held-out split uses other templates and wordings than
the training split (other stories, other chores, other question forms), not only other numbers,
so a held-out success rate measures what was learned, not what was memorised.

Levels are a curriculum of difficulty: 0 gives the exact tool-call line to answer with (in the
Hermes/Qwen `<tool_call>` format the engine parses), 1 names the tool and its arguments in words,
2 only states the task. A split cycles through the levels, so every level is in every sample.
The embedded 135M model almost never calls a tool unprompted; level 0 is where GRPO finds its
first successes.

`generate("arithmetic", split="heldout", n=60)`; `clawr1.envs.task_set("family:arithmetic:heldout")`
for every `--tasks` flag; `clawr1 tasks` writes any family as JSONL (the same format as every task file).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clawr1.core.messages import format_tool_call
from clawr1.envs.base import Task

__all__ = ["SPLITS", "Family", "generate", "parse_spec", "registry", "spell"]

SPLITS = ("train", "heldout")
LEVELS = (0, 1, 2)
#: Seeds of the two splits never meet, even for a family whose templates are shared by accident.
_SPLIT_SEED = {"train": 0, "heldout": 1_000_003}


@dataclass(frozen=True)
class Family:
    """One family. `make(rng, level, heldout)` returns (prompt, files, check, solution, template):
    `solution` is {"calls": [{"name", "arguments"}], "answer": str}; `template` names the template
    used, so the test can prove the splits share none. `tools`: the env's tools its tasks offer
    (None: all), the ones a family's tasks need, as an agent built for one job offers."""

    name: str
    env: str
    doc: str
    make: Callable[[random.Random, int, bool], tuple[str, dict[str, str], dict, dict, str]]
    train_size: int = 300
    heldout_size: int = 60
    tools: tuple[str, ...] | None = None


def generate(family: str, split: str = "train", n: int | None = None, seed: int = 0) -> list[Task]:
    """`n` tasks of `family` from `split` (default: the family's split size), deterministic in
    `seed`. Raises ValueError for an unknown family or split."""
    fam = _family(family)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    heldout = split == "heldout"
    count = n if n is not None else (fam.heldout_size if heldout else fam.train_size)
    if count < 1:
        raise ValueError(f"n must be >= 1, got {count}")
    out = []
    for i in range(count):
        rng = random.Random(f"{fam.name}/{_SPLIT_SEED[split] + seed}/{i}")
        level = LEVELS[i % len(LEVELS)]
        prompt, files, check, solution, template = fam.make(rng, level, heldout)
        meta = {"family": fam.name, "split": split, "level": level, "template": template, "solution": solution}
        out.append(Task(id=f"{fam.name}-{split}-{seed}-{i}", env=fam.env, prompt=prompt, files=files,
                        check=check, meta=meta, tools=fam.tools))
    return out


def spell(level: int, calls: list[dict[str, Any]], heldout: bool) -> str:
    """The level's instruction for `calls` ({"name", "arguments"}), appended to a task's prompt:
    the literal lines (0), the calls in words (1), nothing (2). Held-out wordings differ."""
    if level == 0:
        lines = "\n".join(format_tool_call(c["name"], c["arguments"]) for c in calls)
        return ("\nTo do it, answer with only:\n" if heldout else "\nReply with exactly:\n") + lines
    if level == 1:
        said = "; then ".join(f"{c['name']} with " + ", ".join(f'{k} "{v}"' for k, v in c["arguments"].items())
                              for c in calls)
        return f" The tools can do it: {said}." if heldout else f" Call {said}."
    return ""


def parse_spec(spec: str, default_split: str = "train") -> tuple[str, str] | None:
    """("arithmetic", "heldout") for "family:arithmetic:heldout" (no split: `default_split`); None
    when `spec` is not a family spec."""
    if not spec.startswith("family:"):
        return None
    name, _, split = spec.removeprefix("family:").partition(":")
    return name, split or default_split


def _family(name: str) -> Family:
    families = registry()
    if name not in families:
        raise ValueError(f"unknown task family {name!r}; known: {', '.join(families)}")
    return families[name]


def registry() -> dict[str, Family]:
    """Every family by name."""
    from clawr1.envs.families import files, tools

    return {f.name: f for f in (*tools.FAMILIES, *files.FAMILIES)}
