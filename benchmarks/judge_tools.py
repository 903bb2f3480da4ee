"""The judge on tool messages it never saw, labelled by the environments themselves
(`clawr1 bench judge-tools`).

The shipped evaluation set (`clawr1 bench judge`) was written by the same hands as the
classifier's training set. Here the labels come from elsewhere: for tasks of every family (both
splits), the real envs execute the task's reference tool call and one broken call (an unknown
tool, missing or mistyped arguments, invalid JSON, a bad expression, a key that is not there, a
mistyped shell program, a redirect into a missing folder). Whether the call failed is known
exactly, from the env's own signal (`Env.failed`): a `toolcall` message starting with "Error",
a `terminal` exit code other than 0. Each call is one turn (the task's messages, the call as the model writes
it, the tool message as the next state) with gold +1 for success and -1 for failure.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rich.console import Console

from clawr1.core.config import Config
from clawr1.core.messages import format_tool_call
from clawr1.envs import make_env
from clawr1.envs.base import Task
from clawr1.envs.families import generate, registry
from clawr1.reward.dataset import Item

PER_SPLIT = 16
"""Tasks per family and split; each gives one successful and one failing call."""


def broken(task: Task, k: int) -> tuple[str, Any]:
    """The k-th kind of broken call for `task`'s first reference call: (name, arguments), where
    arguments may be a string that is not valid JSON."""
    call = task.meta["solution"]["calls"][0]
    name, args = call["name"], dict(call["arguments"])
    if task.env == "terminal":
        command = args["command"]
        program, _, rest = command.partition(" ")
        return name, {"command": f"{program}x {rest}" if k % 2 == 0 else re.sub(r"> (\S+)$", r"> missing/\1", command)
                      if ">" in command else f"cat missing-{k}.txt"}
    kind = k % 4
    if kind == 0:
        return f"{name}_tool", args
    if kind == 1:
        return name, json.dumps(args)[:-2]
    if kind == 2:
        return name, {}
    if name == "calculator":
        return name, {"expression": args["expression"].replace("*", "x").replace("+", "plus")}
    if name in ("kv_get", "kv_delete"):
        return name, {"key": f"missing-{args['key']}"}
    first = next(iter(args))
    return name, {**args, first: 42}  # a number where the schema wants a string


def items(per_split: int = PER_SPLIT) -> list[Item]:
    """The labelled turns: one successful and one broken call per task, for every family and split."""
    out = []
    for family in registry():
        for split in ("train", "heldout"):
            for k, task in enumerate(generate(family, split, per_split, seed=7)):
                reference = task.meta["solution"]["calls"][0]
                for tag, (name, args) in (("ok", (reference["name"], reference["arguments"])), ("bad", broken(task, k))):
                    with make_env(task.env) as env:
                        env.reset(task)
                        message = env.call(name, args)
                        bad = env.failed(message)
                    reply = (format_tool_call(name, args) if isinstance(args, dict)
                             else f'<tool_call>{{"name": "{name}", "arguments": {args}</tool_call>')
                    out.append(Item(id=f"{task.id}-{tag}", category="tool_error" if bad else "tool_success",
                                    label=-1 if bad else 1, correction=False,
                                    context=[{"role": "system", "content": env.system},
                                             {"role": "user", "content": task.prompt}],
                                    reply=reply, next_state=[{"role": "tool", "tool_call_id": "call_1", "name": name,
                                                              "content": message}]))
    return out


def run(config: Config, console: Console | None = None, llm: bool = False, per_split: int = PER_SPLIT) -> dict[str, Any]:
    """Rules alone, the classifier alone and both (the default judge) on the env-labelled turns;
    with `llm`, also the configured model as an LLM judge (`reward.m` votes, after the rules), as
    `clawr1 bench judge` runs it. `per_split`: tasks per family and split (the LLM costs seconds
    of CPU a vote)."""
    from benchmarks.judge import run as bench
    from clawr1.reward.classifier import ClassifierJudge
    from clawr1.reward.factory import classifier_available

    console = console or Console()
    labelled = items(per_split)
    judges: list[Any] = ["rules", "classifier"]
    if classifier_available():
        alone = ClassifierJudge.load(config.reward.hint_min_chars)
        alone.name = "classifier alone (no rules)"
        judges.append(alone)
    if llm:
        judges.append("embedded")
    return bench(config, console, judges=judges, items=labelled,
                 title="Judge on env-labelled tool messages (labels from the envs, never trained on)")
