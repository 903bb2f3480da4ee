"""The tool-call env: bad calls become error messages, tools compute the right things, and every
shipped task is solvable by its hand-written solution and unsolved without it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from clawr1.core.config import Config, EnvsConfig
from clawr1.envs import builtin_tasks, load_tasks, make_env
from clawr1.envs.base import Task
from clawr1.envs.calculator import calculate, format_number
from clawr1.envs.toolcall import ToolCallEnv, corpus, search
from clawr1.envs.tools import ToolError

# Each shipped task: the tool calls a correct agent makes, and its final answer.
SOLUTIONS: dict[str, tuple[list[tuple[str, dict[str, Any]]], str]] = {
    "calc-multiply": ([("calculator", {"expression": "37 * 43"})], "The answer is 1591."),
    "calc-divide": ([("calculator", {"expression": "(125 + 375) / 4"})], "125"),
    "calc-power": ([("calculator", {"expression": "2 ** 10"})], "1024"),
    "calc-subtract": ([("calculator", {"expression": "1000 - 357"})], "643"),
    "kv-set-color": ([("kv_set", {"key": "color", "value": "blue"})], "Done."),
    "kv-get-secret": ([("kv_get", {"key": "secret"})], "The value is tulip."),
    "kv-delete-temp": ([("kv_delete", {"key": "temp"})], "Deleted."),
    "kv-count-keys": ([("kv_list", {})], "There are 3 keys."),
    "search-capital": ([("search", {"query": "capital of Veloria"})], "Mirenth"),
    "search-inventor": ([("search", {"query": "Quillon engine"})], "It was invented by Ada Brenner."),
    "search-store-boiling": ([("search", {"query": "zorium boils"}), ("kv_set", {"key": "zorium_bp", "value": "412"})],
                             "Stored."),
    "calc-store-square": ([("calculator", {"expression": "12 * 12"}), ("kv_set", {"key": "square", "value": "144"})],
                          "Stored 144."),
}


def _env(files: dict[str, str] | None = None) -> ToolCallEnv:
    env = ToolCallEnv()
    env.reset(Task(id="t", env="toolcall", prompt="p", files=files or {}))
    return env


@pytest.mark.parametrize(("name", "arguments", "expected"), [
    ("calculator", {}, "missing required argument(s): expression"),
    ("calculator", {"expression": 12}, "'expression' must be of type string, got int"),
    ("calculator", '{"expression": "1 +', "not valid JSON"),
    ("calculator", "[1, 2]", "must be a JSON object, got list"),
    ("calculator", {"expression": "1", "extra": 2}, "unknown argument(s): extra"),
    ("calculator", {"expression": "1 / 0"}, "division by zero"),
    ("calculator", {"expression": "10 % 0"}, "division by zero"),
    ("calculator", {"expression": "__import__('os').system('true')"}, "unsupported expression"),
    ("calculator", {"expression": "9 ** 9 ** 9"}, "too large"),
    # Python computes 10**N for round(int, -N) holding the GIL (N = 10**9 never returns)
    ("calculator", {"expression": "round(5, -10**5)"}, "ndigits -100000 is out of range"),
    ("calculator", {"expression": "(2 ** 4000) ** 999"}, "too large"),
    ("calculator", {"expression": "(3 ** 999) ** 999"}, "too large"),
    ("calculator", {"expression": "1 +"}, "cannot parse"),
    ("search", {"query": "x", "k": True}, "'k' must be of type integer, got bool"),
    ("search", {"query": "x", "k": 50}, "'k' must be <= 10"),
    ("kv_get", {"key": "nope"}, "no such key 'nope'"),
    ("kv_delete", {"key": "nope"}, "no such key 'nope'"),
    ("shell", {"command": "ls"}, "unknown tool 'shell'"),
])
def test_bad_calls_return_an_error_message_instead_of_raising(name: str, arguments: Any, expected: str) -> None:
    reply = _env().call(name, arguments)
    assert reply.startswith("Error: ") and expected in reply, reply


def test_calculator_follows_arithmetic_and_formats_numbers() -> None:
    assert calculate("2 + 3 * 4") == 14
    assert calculate("(2 + 3) * 4") == 20
    assert calculate("-2 ** 2") == -4
    assert calculate("7 // 2") == 3 and calculate("7 % 3") == 1
    assert calculate("max(3, sqrt(16), abs(-5))") == 5
    assert format_number(calculate("0.1 + 0.2")) == "0.3"
    assert format_number(calculate("10 / 4")) == "2.5" and format_number(calculate("10 / 5")) == "2"
    with pytest.raises(ToolError):
        calculate("sqrt(-1)")
    with pytest.raises(ToolError):
        calculate("(-8) ** 0.5")


def test_key_value_store_tools_work_on_the_store() -> None:
    env = _env({"a": "1"})
    assert env.call("kv_set", '{"key": "b", "value": "two"}') == "stored 'b'"
    assert env.call("kv_get", {"key": "b"}) == "two"
    assert json.loads(env.call("kv_list", "")) == ["a", "b"]
    assert env.call("kv_delete", {"key": "a"}) == "deleted 'a'"
    assert env.kv == {"b": "two"}


def test_search_ranks_the_matching_documents_first() -> None:
    assert len(corpus()) >= 30 and len({d["id"] for d in corpus()}) == len(corpus())
    hits = search("capital of Veloria", k=2)
    assert [d["id"] for d in hits] == ["veloria", "mirenth"] or [d["id"] for d in hits] == ["mirenth", "veloria"]
    assert search("Quillon engine")[0]["id"] == "quillon-engine"
    assert search("qwertyuiop") == []
    reply = _env().call("search", {"query": "lumen fox", "k": 1})
    assert reply.startswith("[lumen-fox]") and reply.count("\n") == 0


def test_every_shipped_task_is_solved_by_its_solution_and_not_without_it() -> None:
    tasks = load_tasks(builtin_tasks("toolcall"))
    assert {t.id for t in tasks} == set(SOLUTIONS)
    for task in tasks:
        calls, answer = SOLUTIONS[task.id]
        with make_env("toolcall") as env:
            assert env.reset(task) == task.prompt
            for name, arguments in calls:
                reply = env.call(name, arguments)
                assert not reply.startswith("Error"), (task.id, reply)
            assert env.outcome(answer) == 1.0, task.id
        with make_env("toolcall") as untouched:
            untouched.reset(task)
            assert untouched.outcome("") == -1.0, task.id


def test_make_env_takes_a_whole_config_or_its_envs_section() -> None:
    config = Config()
    assert make_env("toolcall", config).config is config.envs  # type: ignore[attr-defined]
    assert make_env("toolcall", EnvsConfig(max_turns=3)).config.max_turns == 3  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown env"):
        make_env("gui")
    with pytest.raises(ValueError, match="no built-in tasks"):
        builtin_tasks("gui")


def test_a_task_offers_only_the_tools_it_names() -> None:
    env = ToolCallEnv()
    every = ToolCallEnv()
    every.reset(Task(id="all", env="toolcall", prompt="x"))
    env.reset(Task.from_dict({"id": "t", "env": "toolcall", "prompt": "What is 2 + 3?", "tools": ["calculator"]}))
    assert [t["function"]["name"] for t in env.tools()] == ["calculator"] and len(every.tools()) == 6
    assert "calculator" in env.system and "key-value" not in env.system and "search" not in env.system
    assert "key-value store (kv_set, kv_get, kv_delete, kv_list)" in every.system
    assert env.call("calculator", '{"expression": "2 + 3"}') == "5"
    refused = env.call("kv_set", '{"key": "a", "value": "b"}')  # not offered: the agent's mistake
    assert refused.startswith("Error: unknown tool 'kv_set'") and env.kv == {}
    with pytest.raises(ValueError, match="unknown tools"):
        env.reset(Task(id="u", env="toolcall", prompt="x", tools=("calculator", "shell")))
    for bad in ([], "calculator", [""], [3]):
        with pytest.raises(ValueError, match="tools must be"):
            Task.from_dict({"id": "b", "env": "toolcall", "prompt": "x", "tools": bad})


def test_family_tasks_name_their_tools_and_keep_them_through_jsonl(tmp_path) -> None:
    from dataclasses import asdict

    from clawr1.envs.families import generate

    tasks = generate("arithmetic", "heldout", n=2) + generate("multi-step", "heldout", n=1)
    assert [t.tools for t in tasks] == [("calculator",), ("calculator",), None]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(asdict(t)) + "\n" for t in tasks), encoding="utf-8")
    assert load_tasks(path) == tasks
