"""Chat rendering and completion parsing: messages (+ tools) -> prompt ids, text -> content + tool calls.

Models whose chat template knows `tools` (Qwen2.5, Llama 3.1, Hermes, ...) get the tools through
their template. Others (SmolLM2) get our documented convention, a system-prompt section:

    To call a tool, answer with only: <tool_call>{"name": ..., "arguments": {...}}</tool_call>

which is the Hermes/Qwen format, so one parser serves both. A completion whose tool-call block is
not valid JSON is returned as plain content, never an error: the model's output is data.

A reply that is nothing but a bare JSON call of an offered tool, `{"name": "calculator",
"arguments": {...}}` (or a list of them, or one a line, or one in a ```json fence), is taken as
that call too.
Qwen2.5-Coder-0.5B writes its calls so more often than in its template's tags (6 of 8 right calls
were bare, tried as a new user would), and a client that offered tools runs a call, not a JSON
text: the user gets the tool's answer, and the sample's reward is about the call's substance. It
needs the offered tools' names, so a JSON answer that names no offered tool stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from clawr1.core.messages import arguments_value, format_tool_call, text_of
from clawr1.core.types import InvalidRequestError, ParsedCompletion, ToolCall

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

TOOL_PROMPT = """# Tools
You can call these functions:
{tools}
To call a function, answer with only one line per call:
<tool_call>{{"name": "<function name>", "arguments": {{<JSON arguments>}}}}</tool_call>"""

ROLES = {"system", "developer", "user", "assistant", "tool"}


class ChatFormat:
    """Renders conversations for one tokenizer and parses its completions."""

    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; the model must be an instruct/chat model")
        self.tokenizer = tokenizer
        self.native_tools = "tools" in tokenizer.chat_template

    def normalize(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        """Validate OpenAI messages and reduce them to what the chat template can render."""
        if not messages:
            raise InvalidRequestError("messages must be a non-empty array", "messages")
        out: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            where = f"messages[{i}]"
            role = message.get("role") if isinstance(message, dict) else None
            if role not in ROLES:
                raise InvalidRequestError(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}", f"{where}.role")
            content = text_of(message.get("content"), f"{where}.content")
            calls = message.get("tool_calls") or []
            if role == "assistant" and calls:
                fns = [c.get("function", {}) for c in calls]
                if self.native_tools:
                    out.append({"role": "assistant", "content": content, "tool_calls": [
                        {"type": "function",
                         "function": {"name": f.get("name", ""), "arguments": arguments_value(f.get("arguments", "{}"))}}
                        for f in fns
                    ]})
                    continue
                blocks = [format_tool_call(f.get("name", ""), f.get("arguments", "{}")) for f in fns]
                content = "\n".join(([content] if content else []) + blocks)
            out.append({"role": "system" if role == "developer" else role, "content": content})
        if tools and not self.native_tools:
            section = TOOL_PROMPT.format(tools="\n".join(json.dumps(t.get("function", t)) for t in tools))
            if out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + section}
            else:
                out.insert(0, {"role": "system", "content": section})
        return out

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Prompt token ids for a conversation, ending with the assistant generation prompt."""
        normalized = self.normalize(messages, tools)
        kwargs = {"tools": tools} if (tools and self.native_tools) else {}
        text = self.tokenizer.apply_chat_template(normalized, tokenize=False, add_generation_prompt=True, **kwargs)
        # The template already wrote any special tokens (BOS, role markers); do not add them twice.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @staticmethod
    def parse(text: str, tools: list[dict[str, Any]] | None = None) -> ParsedCompletion:
        """Split a completion into content and tool calls; malformed calls leave plain content.
        `tools`: the request's offered tools, whose names a bare JSON call may name."""
        if "<tool_call>" not in text:
            bare = bare_calls(text, tools) if tools else None
            return ParsedCompletion(content=None, tool_calls=bare) if bare else ParsedCompletion(content=text)
        calls = []
        for match in TOOL_CALL_RE.finditer(text):
            try:
                body = json.loads(match.group(1))
            except (json.JSONDecodeError, RecursionError):  # a model can nest deeper than the parser goes
                return ParsedCompletion(content=text)
            if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]:
                return ParsedCompletion(content=text)
            arguments = body.get("arguments", {})
            calls.append(ToolCall(
                id="call_" + uuid.uuid4().hex[:24],
                name=body["name"],
                arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
            ))
        rest = TOOL_CALL_RE.sub("", text).strip()
        return ParsedCompletion(content=rest or None, tool_calls=tuple(calls))


FENCE_RE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def could_be_bare_call(text: str) -> bool:
    """Whether a reply begun so may still turn out to be a bare JSON call (streams hold it back)."""
    start = text.lstrip()
    return start.startswith(("{", "[", "```")) or (bool(start) and "```".startswith(start))


def bare_calls(text: str, tools: list[dict[str, Any]]) -> tuple[ToolCall, ...] | None:
    """The reply as tool calls when it is only a JSON call (or a list of calls) of offered tools."""
    body = text.strip()
    fenced = FENCE_RE.match(body)
    body = fenced.group(1) if fenced else body
    if not body.startswith(("{", "[")):
        return None
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        value = _json_lines(body)
        if value is None:
            return None
    names = {t.get("function", t).get("name") for t in tools}
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(i, dict) and i.get("name") in names and set(i) <= {"name", "arguments"}
                            and isinstance(i.get("arguments", {}), (dict, str)) for i in items):
        return None
    return tuple(ToolCall(id="call_" + uuid.uuid4().hex[:24], name=i["name"],
                          arguments=i.get("arguments", {}) if isinstance(i.get("arguments"), str)
                          else json.dumps(i.get("arguments", {}))) for i in items)


def _json_lines(body: str) -> list[Any] | None:
    """One JSON value a line (several calls, as the template's one `<tool_call>` a line writes them:
    3% of Qwen's first calls on the task families); None unless every non-empty line is one."""
    out = []
    for line in body.splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except (json.JSONDecodeError, RecursionError):
                return None
    return out
