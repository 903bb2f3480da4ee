"""Terminal and SWE envs: every shipped task's checker passes on a hand-written solution and
fails on the untouched workspace; checkers cannot be fooled into reading host files; a bug fix
makes the tests pass."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from clawr1.envs import builtin_tasks, load_tasks, make_env
from clawr1.envs.base import Task
from clawr1.envs.checks import CheckContext, check
from clawr1.envs.swe import SWEEnv
from clawr1.envs.terminal import TerminalEnv

T = TypeVar("T")

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


def test_swe_tests_skipped_on_import_do_not_pass() -> None:
    task = load_tasks(builtin_tasks("swe"))[0]
    with SWEEnv() as env:
        env.reset(task)
        skip = "import unittest\nraise unittest.SkipTest('later')\n"
        assert env.call("write_file", {"path": "mathutil.py", "content": skip}).startswith("wrote")
        assert "OK (skipped=1)" in env.call("run_tests", {})
        assert env.outcome("done") == -1.0


def _unless_blocked_on(fifo: Path, call: Callable[[], T]) -> T:
    """`call()`, failing (not hanging) if it blocks writing into `fifo`, which waits for a reader."""
    result: list[T] = []
    worker = threading.Thread(target=lambda: result.append(call()), daemon=True)
    worker.start()
    worker.join(30)
    hung = worker.is_alive()
    if hung and fifo.is_fifo():  # a reader comes and goes: the writer gets EPIPE and the thread ends
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    assert not hung, f"blocked writing into {fifo.name}"
    assert result, "the call raised"
    return result[0]


@pytest.mark.parametrize("plant", ["directory", "fifo", "symlink"])
def test_swe_outcome_restores_tests_over_whatever_replaced_them(plant: str, tmp_path: Path) -> None:
    task = load_tasks(builtin_tasks("swe"))[0]
    path, old, new = SWE_FIXES[task.id]
    with SWEEnv() as env:
        env.reset(task)
        assert env.call("replace_in_file", {"path": path, "old": old, "new": new}).startswith("replaced 1")
        test_file = env.workdir / next(name for name in task.files if name.startswith("test"))
        test_file.unlink()
        if plant == "directory":
            (test_file / "inner").mkdir(parents=True)
        elif plant == "fifo":
            os.mkfifo(test_file)
        else:
            test_file.symlink_to(tmp_path / "elsewhere.py")
        assert _unless_blocked_on(test_file, lambda: env.outcome("fixed")) == 1.0
        assert test_file.is_file() and not test_file.is_symlink()
    assert not (tmp_path / "elsewhere.py").exists()


@pytest.mark.parametrize(("arguments", "expected"), [
    ({"path": "mathutil.py/x.py", "content": "x"}, "Error: cannot write 'mathutil.py/x.py'"),
    ({"path": "a.py", "content": "\ud800"}, "Error: content is not valid text"),
    ({"path": "pipe", "content": "x"}, "Error: 'pipe' is a directory or another non-regular file"),
])
def test_swe_write_file_reports_what_it_cannot_write(arguments: dict[str, str], expected: str) -> None:
    task = load_tasks(builtin_tasks("swe"))[0]
    with SWEEnv() as env:
        env.reset(task)
        os.mkfifo(env.workdir / "pipe")
        reply = _unless_blocked_on(env.workdir / "pipe", lambda: env.call("write_file", arguments))
        assert reply.startswith(expected), reply
        (env.workdir / "latin1.py").write_bytes(b"x = '\xe9'\n")
        reply = env.call("replace_in_file", {"path": "latin1.py", "old": "x", "new": "y"})
        assert reply.startswith("Error: 'latin1.py' is not UTF-8 text")
