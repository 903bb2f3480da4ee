"""Rule evidence: what tool output says about a turn without asking any model.

Only tool messages are read: a user's words need judgement (a pasted traceback may come with a
correction or with "as expected"). Any error in any tool message gives -1. +1 needs a success
signal and no user message in the next state, because a user who speaks after a green test run
may still be correcting the reply; their words go to the judge instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from clawr1.reward.turn import message_text, role_of
from clawr1.reward.types import Message

# "exit code 1", "exited with 2", "exited with code 2", "returncode=1", "exit status: 3"; the
# qualifier is required so a bare "return 0" in printed source code is not read as an exit code.
EXIT_RE = re.compile(r"\b(?:exit(?:ed)?|return)(?:[ _]?(?:with|code|status))+\s*[:=]?\s*(-?\d+)\b", re.IGNORECASE)

# (label, pattern, informative): informative lines say *what* failed and can become a hint.
NEGATIVE: tuple[tuple[str, re.Pattern[str], bool], ...] = (
    ("traceback", re.compile(r"Traceback \(most recent call last\)"), False),
    ("exception", re.compile(r"(?m)^\s*(?:E\s+)?(?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception)\b(?::|$)"), True),
    ("error", re.compile(r"(?m)(?:^|[\s:])(?:error|Error|ERROR)(?:\[\w+\])?:"), True),
    ("fatal", re.compile(r"(?m)^(?:fatal|FATAL):"), True),
    ("npm error", re.compile(r"npm ERR!"), True),
    ("assertion", re.compile(r"\bAssertionError\b"), True),
    ("failed tests", re.compile(r"\b[1-9]\d* failed\b"), False),
    ("failed test", re.compile(r"(?m)^(?:FAILED|FAIL)\b|\bFAILED \("), True),
    ("missing", re.compile(r"command not found|No such file or directory|Permission denied"), True),
    ("http error", re.compile(r"\bHTTP(?:/\d(?:\.\d)?)?\s+[45]\d\d\b"), True),
    ("error field", re.compile(r'"error"\s*:\s*["{]'), True),
)
POSITIVE: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("tests passed", re.compile(r"\b[1-9]\d* passed\b")),
    ("unittest OK", re.compile(r"(?m)^OK\b")),
    ("clean check", re.compile(r"All checks passed|Success: no issues found|\b0 errors\b|Successfully installed")),
)


@dataclass(frozen=True)
class Evidence:
    """A rule's verdict: the score, a readable why, and the informative lines (hint material)."""

    score: int
    text: str
    lines: tuple[str, ...] = ()


def _line_at(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text[start:end if end >= 0 else len(text)].strip()


def _short(line: str, limit: int = 160) -> str:
    return line if len(line) <= limit else line[: limit - 3] + "..."


def tool_failures(text: str) -> list[tuple[str, str, bool]]:
    """Every failure signal in one tool output: (label, matching line, informative)."""
    found = [(label, _line_at(text, m.start()), info) for label, rx, info in NEGATIVE for m in rx.finditer(text)]
    found += [("exit code", _line_at(text, m.start()), False) for m in EXIT_RE.finditer(text) if int(m.group(1)) != 0]
    return found


def _successes(text: str) -> list[tuple[str, str]]:
    found = [(label, _line_at(text, m.start())) for label, rx in POSITIVE for m in rx.finditer(text)]
    found += [("exit code 0", _line_at(text, m.start())) for m in EXIT_RE.finditer(text) if int(m.group(1)) == 0]
    return found


def _describe(found: dict[tuple[str, str], list[str]]) -> str:
    """`rule: tool (bash) exception, assertion: <line>; ...`, one entry per distinct line."""
    return "rule: " + "; ".join(f"{role} {', '.join(dict.fromkeys(labels))}: {line}" for (role, line), labels in found.items())


def rule_evidence(next_state: list[Message]) -> Evidence | None:
    """-1 on any tool failure, +1 on an unambiguous tool success, else None (no rule applies)."""
    failures: dict[tuple[str, str], list[str]] = {}  # (role, line) -> labels that matched it
    informative: list[str] = []
    successes: dict[tuple[str, str], list[str]] = {}
    for i, message in enumerate(next_state):
        if message.get("role") != "tool":
            continue
        text = message_text(message, f"next_state[{i}].content")
        for label, line, info in tool_failures(text):
            failures.setdefault((role_of(message), _short(line)), []).append(label)
            if info and line not in informative:
                informative.append(line)
        for label, line in _successes(text):
            successes.setdefault((role_of(message), _short(line)), []).append(label)
    if failures:
        return Evidence(-1, _describe(failures), tuple(informative))
    if successes and not any(m.get("role") == "user" for m in next_state):
        return Evidence(1, _describe(successes))
    return None
