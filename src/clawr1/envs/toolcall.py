"""`toolcall`: OpenAI-style function tools executed in-process.

Tools: `calculator` (safe arithmetic), a key-value store (`kv_set`, `kv_get`, `kv_delete`,
`kv_list`) and `search` over a small shipped corpus (`data/corpus.jsonl`, ranked by idf-weighted
term overlap). A task's `files` are the store's initial contents. Every argument is validated
against the tool's JSON schema first, so the env is also a test of whether the model calls tools
correctly: a wrong call costs a turn and shows the model an "Error: ..." message.
"""

from __future__ import annotations

import functools
import json
import math
import re
from importlib import resources
from typing import Any

from clawr1.core.config import EnvsConfig
from clawr1.envs.base import Task
from clawr1.envs.calculator import calculate, format_number
from clawr1.envs.checks import CheckContext, check
from clawr1.envs.tools import ToolEnv, ToolError, function_tool

MAX_KEYS = 1000
_KEY = {"type": "string", "description": "The key.", "maxLength": 200}
_TOOLS = [
    function_tool("calculator", "Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses, "
                  "abs, round, min, max, sqrt. Example: (3 + 4) * 2",
                  {"expression": {"type": "string", "description": "The expression.", "maxLength": 500}},
                  ["expression"]),
    function_tool("kv_set", "Store a value under a key (replacing any old value).",
                  {"key": _KEY, "value": {"type": "string", "description": "The value.", "maxLength": 10_000}},
                  ["key", "value"]),
    function_tool("kv_get", "Read the value stored under a key.", {"key": _KEY}, ["key"]),
    function_tool("kv_delete", "Delete a key and its value.", {"key": _KEY}, ["key"]),
    function_tool("kv_list", "List all keys in the store."),
    function_tool("search", "Search the document collection; returns the best matching documents.",
                  {"query": {"type": "string", "description": "Search words.", "maxLength": 1000},
                   "k": {"type": "integer", "description": "How many documents (1-10).", "minimum": 1,
                         "maximum": 10, "default": 3}},
                  ["query"]),
]


@functools.cache
def corpus() -> tuple[dict[str, str], ...]:
    """The shipped documents: {id, title, text} per line of `data/corpus.jsonl`."""
    text = resources.files("clawr1.envs").joinpath("data", "corpus.jsonl").read_text(encoding="utf-8")
    return tuple(json.loads(line) for line in text.splitlines() if line.strip())


def _terms(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


@functools.cache
def _index() -> tuple[list[set[str]], dict[str, float]]:
    docs = [_terms(d["title"] + " " + d["text"]) for d in corpus()]
    df: dict[str, int] = {}
    for terms in docs:
        for t in terms:
            df[t] = df.get(t, 0) + 1
    return docs, {t: math.log(1 + len(docs) / n) for t, n in df.items()}


def search(query: str, k: int = 3) -> list[dict[str, str]]:
    """The `k` documents sharing the most (idf-weighted) terms with `query`; none when nothing
    matches. Ties keep corpus order, so results are deterministic."""
    docs, idf = _index()
    q = _terms(query)
    scored = [(sum(idf[t] for t in q & terms), i) for i, terms in enumerate(docs)]
    ranked = sorted((s for s in scored if s[0] > 0), key=lambda s: (-s[0], s[1]))
    return [corpus()[i] for _, i in ranked[:k]]


_KV = ("kv_set", "kv_get", "kv_delete", "kv_list")


def _system(names: set[str]) -> str:
    kinds = [what for what, tools in (("a calculator", ("calculator",)),
                                      (f"a key-value store ({', '.join(n for n in _KV if n in names)})", _KV),
                                      ("a document search", ("search",))) if names & set(tools)]
    listed = kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " and " + kinds[-1]
    return (f"You are an assistant with {'tools' if len(names) > 1 else 'a tool'}: {listed}. Call tools to do "
            "the task. When it is done, reply with a short final answer and no tool call.")


class ToolCallEnv(ToolEnv):
    name = "toolcall"

    def __init__(self, config: EnvsConfig | None = None):
        self.config = config or EnvsConfig()
        self.kv: dict[str, str] = {}
        self._task: Task | None = None
        self._offered = _TOOLS

    @property
    def system(self) -> str:  # type: ignore[override]  # per task: it names the offered tools only
        return _system({t["function"]["name"] for t in self._offered})

    def tools(self) -> list[dict[str, Any]]:
        return self._offered

    def reset(self, task: Task) -> str:
        self.kv = dict(task.files)
        self._task = task
        self._offered = _TOOLS
        if task.tools is not None:
            names = {t["function"]["name"] for t in _TOOLS}
            if unknown := sorted(set(task.tools) - names):
                raise ValueError(f"task {task.id!r} offers unknown tools {unknown}; toolcall has {sorted(names)}")
            self._offered = [t for t in _TOOLS if t["function"]["name"] in task.tools]
        return task.prompt

    def outcome(self, final_answer: str | None = None) -> float:
        if self._task is None:
            raise RuntimeError("outcome() before reset()")
        return 1.0 if check(self._task.check, CheckContext(final_answer=final_answer, kv=self.kv)) else -1.0

    def tool_calculator(self, expression: str) -> str:
        return format_number(calculate(expression))

    def tool_kv_set(self, key: str, value: str) -> str:
        if key not in self.kv and len(self.kv) >= MAX_KEYS:
            raise ToolError(f"the store is full ({MAX_KEYS} keys)")
        self.kv[key] = value
        return f"stored {key!r}"

    def tool_kv_get(self, key: str) -> str:
        if key not in self.kv:
            raise ToolError(f"no such key {key!r}")
        return self.kv[key]

    def tool_kv_delete(self, key: str) -> str:
        if key not in self.kv:
            raise ToolError(f"no such key {key!r}")
        del self.kv[key]
        return f"deleted {key!r}"

    def tool_kv_list(self) -> str:
        return json.dumps(sorted(self.kv))

    def tool_search(self, query: str, k: int = 3) -> str:
        hits = search(query, k)
        if not hits:
            return "no documents match"
        return "\n".join(f"[{d['id']}] {d['title']}: {d['text']}" for d in hits)
