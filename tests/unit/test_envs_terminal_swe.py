"""Terminal and SWE envs: every shipped task's checker passes on a hand-written solution and
fails on the untouched workspace; checkers cannot be fooled into reading host files; a bug fix
makes the tests pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from clawr1.envs import builtin_tasks, load_tasks, make_env
from clawr1.envs.base import Task
from clawr1.envs.checks import CheckContext, check
from clawr1.envs.swe import SWEEnv
from clawr1.envs.terminal import TerminalEnv

TERMINAL_SOLUTIONS: dict[str, tuple[str, str]] = {  # task id -> (shell command, final answer)
    "create-hello": ("echo 'hello world' > hello.txt", "done"),
    "count-lines": ("wc -l < data.txt > count.txt", "done"),
    "sort-names": ("sort names.txt > sorted.txt", "done"),
    "rename-file": ("mv old.txt new.txt", "done"),
    "grep-errors": ("grep ERROR log.txt > errors.txt", "done"),
    "make-directory": ("mkdir backup", "done"),
    "copy-file": ("cp notes.txt notes_copy.txt", "done"),
    "delete-file": ("rm temp.txt", "done"),
    "append-line": ("echo eggs >> list.txt", "done"),
    "uppercase": ("tr a-z A-Z < word.txt > upper.txt", "done"),
    "first-line": ("head -n 1 poem.txt > first.txt", "done"),
    "contains-word": ("echo 'buy milk' > todo.txt", "done"),
    "make-executable": ("chmod +x run.sh", "done"),
    "count-files": ("ls docs", "There are 3 files."),
}
SWE_FIXES: dict[str, tuple[str, str, str]] = {  # task id -> replace_in_file(path, old, new)
    "add-subtracts": ("mathutil.py", "return a - b", "return a + b"),
    "is-even-inverted": ("parity.py", "n % 2 == 1", "n % 2 == 0"),
    "reverse-noop": ("strings.py", "s[::1]", "s[::-1]"),
    "factorial-range": ("factorial.py", "range(1, n)", "range(1, n + 1)"),
    "vowels-missing-u": ("vowels.py", 'VOWELS = "aeio"', 'VOWELS = "aeiou"'),
    "fahrenheit-sign": ("temperature.py", "9 / 5 - 32", "9 / 5 + 32"),
}


def test_every_terminal_task_is_solved_by_its_solution_and_not_without_it() -> None:
    tasks = load_tasks(builtin_tasks("terminal"))
    assert {t.id for t in tasks} == set(TERMINAL_SOLUTIONS)
    for task in tasks:
        command, answer = TERMINAL_SOLUTIONS[task.id]
        with make_env("terminal") as env:
            env.reset(task)
            reply = env.call("run", {"command": command})
            assert reply.startswith("exit code: 0"), (task.id, reply)
            assert env.outcome(answer) == 1.0, task.id
        with make_env("terminal") as untouched:
            untouched.reset(task)
            assert untouched.outcome("") == -1.0, task.id


def test_terminal_tool_message_is_the_next_state_and_bad_calls_are_errors() -> None:
    with TerminalEnv() as env:
        env.reset(Task(id="t", env="terminal", prompt="p", files={"a.txt": "hi\n"}))
        assert env.workdir is not None and (env.workdir / "a.txt").read_text() == "hi\n"
        assert env.call("run", '{"command": "cat a.txt; ls nope"}') == ("exit code: 2\nstdout:\nhi\nstderr:\n"
                                                                       "ls: cannot access 'nope': No such file or directory")
        assert env.call("run", {}).startswith("Error: run is missing required argument(s): command")
        assert env.call("run", "{not json").startswith("Error: arguments of run are not valid JSON")
        assert env.call("run", {"command": ["ls"]}).startswith("Error: run: argument 'command' must be of type string")
        assert env.call("bash", {"command": "ls"}).startswith("Error: unknown tool 'bash'")
        workdir = env.workdir
    assert not workdir.exists()


def test_checkers_do_not_follow_planted_symlinks_out_of_the_workspace(tmp_path: Path) -> None:
    secret = tmp_path / "host.txt"
    secret.write_text("hello world\n")
    task = next(t for t in load_tasks(builtin_tasks("terminal")) if t.id == "create-hello")
    with make_env("terminal") as env:
        env.reset(task)
        assert env.call("run", {"command": f"ln -s {secret} hello.txt"}).startswith("exit code: 0")
        assert (env.workdir / "hello.txt").is_symlink()  # copied back to the host as a symlink
        assert env.outcome("done") == -1.0
        ctx = CheckContext(workdir=env.workdir)
        assert not check({"type": "file_exists", "path": "../../" + str(secret)}, ctx)
        assert not check({"type": "file_absent", "path": str(secret)}, ctx)
        with pytest.raises(ValueError, match="unknown check type"):
            check({"type": "file_is_nice", "path": "x"}, ctx)


def test_every_swe_task_fails_untouched_and_passes_after_its_one_line_fix() -> None:
    tasks = load_tasks(builtin_tasks("swe"))
    assert {t.id for t in tasks} == set(SWE_FIXES)
    for task in tasks:
        path, old, new = SWE_FIXES[task.id]
        with make_env("swe") as env:
            env.reset(task)
            assert env.outcome() == -1.0, task.id
            assert env.call("replace_in_file", {"path": path, "old": old, "new": new}).startswith("replaced 1")
            tests = env.call("run_tests", "")
            assert tests.startswith("exit code: 0") and "\nOK" in tests, (task.id, tests)
            assert env.outcome("fixed") == 1.0, task.id


def test_swe_outcome_is_the_original_tests_not_edited_ones() -> None:
    task = load_tasks(builtin_tasks("swe"))[0]
    with SWEEnv() as env:
        env.reset(task)
        test_file = next(name for name in task.files if name.startswith("test"))
        passing = "import unittest\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n"
        assert env.call("write_file", {"path": test_file, "content": passing}).startswith("wrote")
        assert env.call("run_tests", {}).startswith("exit code: 0")  # the edited test passes...
        assert env.outcome() == -1.0  # ...but the reward runs the task's own tests
        assert env.call("write_file", {"path": "unittest.py", "content": "print('Ran 1 test in 0s'); print('OK')"})
        assert env.outcome() == -1.0


def test_swe_file_tools_stay_inside_the_workspace_and_report_mistakes() -> None:
    task = load_tasks(builtin_tasks("swe"))[0]
    with SWEEnv() as env:
        env.reset(task)
        assert "def add" in env.call("read_file", {"path": "mathutil.py"})
        assert env.call("read_file", {"path": "../../etc/passwd"}).startswith("Error: path '../../etc/passwd' is outside")
        assert env.call("read_file", {"path": "/etc/passwd"}).startswith("Error: path '/etc/passwd' is outside")
        assert env.call("write_file", {"path": "/tmp/x.py", "content": ""}).startswith("Error:")
        assert env.call("read_file", {"path": "missing.py"}) == "Error: no such file 'missing.py'"
        reply = env.call("replace_in_file", {"path": "mathutil.py", "old": "nothing like this", "new": "x"})
        assert reply.startswith("Error: `old` occurs 0 times")
        assert env.call("replace_in_file", {"path": "mathutil.py", "old": "a"}).startswith("Error: replace_in_file is "
                                                                                           "missing required")
