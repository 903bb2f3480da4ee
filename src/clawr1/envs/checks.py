"""Task checkers: a task's `check` spec says what a solved episode looks like.

Specs are small JSON objects with a `type`:

- `file_equals` {path, text}: the file's text equals `text` (trailing newlines ignored, since
  `echo` adds one);
- `file_contains` {path, text}: the file contains `text`;
- `file_exists` / `file_absent` {path}: a regular file is there / nothing is there;
- `command` {command}: a check command run in the sandbox exits 0;
- `answer_contains` {text, whole_word?}: the final answer contains `text` (case-insensitive;
  `whole_word` stops "3" from matching "13", "-3" or "3.5", and "tern" from matching "western";
  a number may be written with thousands separators, "4,851");
- `kv_equals` {key, value}: the tool-call env's store holds `value` under `key` (compared
  stripped and case-folded); `value: null` means the key must be absent;
- `all` {checks: [...]}: every sub-check passes.

File checks read on the host through `tools.read_text`, which refuses paths that leave the
workspace, so a planted symlink cannot make a checker read host files.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clawr1.envs.sandbox import SandboxResult
from clawr1.envs.tools import ToolError, inside, read_text


@dataclass
class CheckContext:
    """What a checker may look at: the workspace, a way to run a command in the sandbox, the
    final answer, and the key-value store (tool-call env)."""

    workdir: Path | None = None
    run: Callable[[str], SandboxResult] | None = None
    final_answer: str | None = None
    kv: dict[str, str] = field(default_factory=dict)


def check(spec: dict[str, Any], ctx: CheckContext) -> bool:
    """True when `spec` holds. Raises ValueError for a spec this module does not know (a bug in
    the task set, which must not silently score -1)."""
    kind = spec.get("type")
    if kind == "all":
        return all(check(sub, ctx) for sub in spec["checks"])
    if kind == "answer_contains":
        return _answer_contains(ctx.final_answer or "", str(spec["text"]), bool(spec.get("whole_word", False)))
    if kind == "kv_equals":
        want = spec["value"]
        have = ctx.kv.get(str(spec["key"]))
        return have is None if want is None else have is not None and _norm(have) == _norm(str(want))
    if kind == "command":
        if ctx.run is None:
            raise ValueError("a `command` check needs a sandbox")
        result = ctx.run(str(spec["command"]))
        return result.exit_code == 0 and result.killed is None
    if kind in ("file_equals", "file_contains", "file_exists", "file_absent"):
        if ctx.workdir is None:
            raise ValueError(f"a `{kind}` check needs a workspace")
        return _file_check(kind, spec, ctx.workdir)
    raise ValueError(f"unknown check type {kind!r} in {spec}")


def _file_check(kind: str, spec: dict[str, Any], workdir: Path) -> bool:
    rel = str(spec["path"])
    if kind == "file_absent":
        try:
            inside(workdir, rel)
        except ToolError:
            return False
        return not os.path.lexists(workdir / rel)  # a dangling symlink is still something there
    text = read_text(workdir, rel)
    if text is None:
        return False
    if kind == "file_equals":
        return text.rstrip("\n") == str(spec["text"]).rstrip("\n")
    if kind == "file_contains":
        return str(spec["text"]) in text
    return True  # file_exists


_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")


def _answer_contains(answer: str, text: str, whole_word: bool) -> bool:
    if not whole_word:
        return text.casefold() in answer.casefold()
    if _NUMBER.fullmatch(text.strip()):
        pattern = _number_pattern(text.strip())
    else:
        pattern = rf"(?<!\w){re.escape(text)}(?!\w)"
    return re.search(pattern, answer, flags=re.IGNORECASE) is not None


def _number_pattern(number: str) -> str:
    """A whole number: thousands separators are optional ("4,851" is 4851), but a sign, digits or
    a decimal part around it make it another number ("-66", "0.66", "66.5", "3,966" are not 66).
    A full stop or comma that ends a sentence or clause is still fine ("It is 66.")."""
    sign = "-" if number.startswith("-") else ""
    whole, dot, fraction = number.removeprefix("-").replace(",", "").partition(".")
    head = len(whole) % 3 or 3
    groups = [whole[:head]] + [whole[i:i + 3] for i in range(head, len(whole), 3)]
    body = re.escape(sign) + ",?".join(groups) + (r"\." + fraction if dot else "")
    return rf"(?<![\w.-])(?<!\d,){body}(?!\w)(?![.,]\d)"


def _norm(value: str) -> str:
    return value.strip().casefold()
