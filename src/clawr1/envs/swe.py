"""`swe`: fix a bug in a tiny repository until its unit tests pass.

A task's `files` are a small module with a bug and a stdlib `unittest` test file (no pytest needed
inside the sandbox). Tools: `read_file`, `write_file`, `replace_in_file` (host-side, confined to
the workspace) and `run_tests` (`python3 -m unittest` in the sandbox). The reward is the tests:
1 pass, -1 fail. Before the final run the task's test files (names starting with `test`) are
restored, so editing the tests is not a way to pass them; `-I` keeps the workspace off `sys.path`
until discovery, so a planted `unittest.py` does not replace the runner; and the run must report
at least one test and `OK`, so a module that exits 0 on import does not pass either. (A model set
on cheating could still fake the report from inside the module under test; the tiny models this
set is for do not.)
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from clawr1.envs.sandbox import SandboxResult
from clawr1.envs.sandboxed import SandboxEnv
from clawr1.envs.tools import ToolError, function_tool, inside, write_files

TEST_COMMAND = "python3 -B -I -m unittest"
_PATH = {"type": "string", "description": "File path relative to the repository root, e.g. `mathutil.py`.",
         "maxLength": 500}
_TOOLS = [
    function_tool("read_file", "Read a file of the repository.", {"path": _PATH}, ["path"]),
    function_tool("write_file", "Create or overwrite a file with the given content.",
                  {"path": _PATH, "content": {"type": "string", "description": "The whole new content."}},
                  ["path", "content"]),
    function_tool("replace_in_file", "Replace one exact occurrence of `old` by `new` in a file.",
                  {"path": _PATH, "old": {"type": "string", "description": "Text to find (must occur exactly once)."},
                   "new": {"type": "string", "description": "Replacement text."}},
                  ["path", "old", "new"]),
    function_tool("run_tests", "Run the repository's unit tests and show the result."),
]


def tests_passed(result: SandboxResult) -> bool:
    """unittest exited 0 on its own and reported at least one test run and a bare `OK`: `OK
    (skipped=1)` does not count, since a module under test that raises `unittest.SkipTest` on
    import skips the tests instead of passing them."""
    ran = re.search(r"^Ran (\d+) tests? in ", result.stderr, flags=re.MULTILINE)
    return (result.exit_code == 0 and result.killed is None and ran is not None and int(ran.group(1)) > 0
            and re.search(r"^OK$", result.stderr, flags=re.MULTILINE) is not None)


class SWEEnv(SandboxEnv):
    name = "swe"
    TOOLS = _TOOLS
    system = ("You are a software engineer fixing a bug in a small Python repository. Use read_file to read "
              "code, replace_in_file or write_file to change it, and run_tests to run the unit tests. When the "
              "tests pass, reply with a short summary and no tool call.")

    def tool_read_file(self, path: str) -> str:
        file = inside(self._box().workdir, path)
        if not file.is_file():
            raise ToolError(f"no such file {path!r}")
        text = file.read_text(encoding="utf-8", errors="replace")
        keep = self.config.output_chars
        return text if len(text) <= keep else text[:keep] + f"\n[... {len(text) - keep} more characters cut]"

    def tool_write_file(self, path: str, content: str) -> str:
        data = _encode(content)
        if len(data) > self.config.disk_mb << 20:
            raise ToolError(f"content is larger than {self.config.disk_mb} MB")
        file = inside(self._box().workdir, path)
        if file.exists() and not file.is_file():  # a FIFO would block the write until a reader comes
            raise ToolError(f"{path!r} is a directory or another non-regular file")
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_bytes(data)
        except OSError as err:  # e.g. a parent that is a file: `mathutil.py/x.py`
            raise ToolError(f"cannot write {path!r}: {err.strerror or err}") from None
        return f"wrote {len(content)} characters to {path}"

    def tool_replace_in_file(self, path: str, old: str, new: str) -> str:
        file = inside(self._box().workdir, path)
        if not file.is_file():
            raise ToolError(f"no such file {path!r}")
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ToolError(f"{path!r} is not UTF-8 text; use write_file to replace it whole") from None
        count = text.count(old) if old else 0
        if count != 1:
            raise ToolError(f"`old` occurs {count} times in {path}; it must occur exactly once (add context)")
        file.write_bytes(_encode(text.replace(old, new, 1)))
        return f"replaced 1 occurrence in {path}"

    def tool_run_tests(self) -> str:
        return self._box().run(TEST_COMMAND).message()

    def outcome(self, final_answer: str | None = None) -> float:
        task, box = self._started()
        tests = {k: v for k, v in task.files.items() if Path(k).name.startswith("test")}
        for rel in tests:
            _remove(box.workdir / rel)
        write_files(box.workdir, tests)
        return 1.0 if tests_passed(box.run(TEST_COMMAND)) else -1.0


def _encode(text: str) -> bytes:
    """`text` as UTF-8, or a `ToolError` for what has no encoding (a lone surrogate such as
    "\\ud800", which JSON arguments can carry)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ToolError(f"content is not valid text ({err.reason} at position {err.start})") from None


def _remove(path: Path) -> None:
    """Remove whatever the agent's code left where a test file is restored: a symlink would make
    the restore write elsewhere, a directory makes it raise, and a FIFO blocks it forever."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
