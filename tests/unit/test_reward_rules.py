"""Rule evidence from tool output, with no model call."""

from __future__ import annotations

import pytest

from clawr1.reward.rules import rule_evidence


def tool(text: str, name: str = "bash") -> dict:
    return {"role": "tool", "tool_call_id": "call_1", "name": name, "content": text}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


TRACEBACK = 'Traceback (most recent call last):\n  File "x.py", line 3, in <module>\nKeyError: \'id\''


@pytest.mark.parametrize("output, label", [
    (TRACEBACK, "exception"),
    ("ValueError: invalid literal for int() with base 10: 'a'", "exception"),
    ("requests.exceptions.ConnectionError: connection refused", "exception"),
    ("Error: ENOENT: no such file or directory", "error"),
    ("src/a.py:3: error: Name 'x' is not defined", "error"),
    ("error[E0308]: mismatched types", "error"),
    ("fatal: not a git repository", "fatal"),
    ("done\nexit code 1", "exit code"),
    ("Process exited with 2", "exit code"),
    ("exited with code 127", "exit code"),
    ("returncode=1", "exit code"),
    ("exit status: 3", "exit code"),
    ("FAILED tests/test_a.py::test_b - assert 1 == 2\n1 failed, 3 passed in 0.2s", "failed test"),
    ("Tests: 2 failed, 5 passed", "failed tests"),
    ("E   AssertionError: expected 4", "assertion"),
    ("FAILED (failures=1)", "failed test"),
    ("bash: jq: command not found", "missing"),
    ("HTTP/1.1 500 Internal Server Error", "http error"),
    ('{"error": "quota exceeded"}', "error field"),
    ("npm ERR! code E404", "npm error"),
])
def test_failures_give_minus_one_with_evidence(output, label):
    evidence = rule_evidence([tool(output)])
    assert evidence is not None and evidence.score == -1
    assert evidence.text.startswith("rule: tool (bash) ") and label in evidence.text


@pytest.mark.parametrize("output", [
    "12 passed in 0.84s", "Ran 5 tests in 0.01s\n\nOK", "exit code 0", "Process exited with code 0",
    "All checks passed!", "Success: no issues found in 3 source files", "Successfully installed httpx-0.28.1",
])
def test_unambiguous_successes_give_plus_one(output):
    evidence = rule_evidence([tool(output)])
    assert evidence is not None and evidence.score == 1 and evidence.text.startswith("rule: ")


@pytest.mark.parametrize("next_state", [
    [user("Thanks!")],
    [user("I ran it and got:\n" + TRACEBACK)],  # a user's words need judgement, even around a traceback
    [tool("wrote report.txt (12 lines)")],
    [tool('{"status": "sent"}')],
    [tool("")],
    [tool("def f():\n    return 0\n")],  # source code that returns 0 is not an exit code
    [tool('{"error": null, "ok": true}')],
    [tool("Found 0 failed checks")],
    [tool("12 passed in 0.84s"), user("Good, but rename the test file.")],  # the user may still be correcting
])
def test_no_rule_applies(next_state):
    assert rule_evidence(next_state) is None


def test_a_failure_anywhere_wins_over_success_elsewhere():
    evidence = rule_evidence([tool("3 passed"), tool("exit code 2"), user("hm")])
    assert evidence is not None and evidence.score == -1 and "exit code 2" in evidence.text


def test_informative_lines_are_kept_once_for_hints():
    output = "E   AssertionError: assert 4 == 3\nFAILED t.py::test_total - AssertionError: assert 4 == 3\n1 failed"
    evidence = rule_evidence([tool(output)])
    assert evidence is not None
    assert evidence.lines == ("E   AssertionError: assert 4 == 3", "FAILED t.py::test_total - AssertionError: assert 4 == 3")
    assert evidence.text.count("FAILED t.py::test_total") == 1  # one entry per line, all labels on it


def test_content_parts_are_read():
    message = {"role": "tool", "content": [{"type": "text", "text": "Traceback (most recent call last):\n"},
                                            {"type": "text", "text": "OSError: disk full"}]}
    evidence = rule_evidence([message])
    assert evidence is not None and evidence.score == -1 and "OSError: disk full" in evidence.text
    assert "; tool exception: OSError" in evidence.text  # a tool message without a name is just "tool"
