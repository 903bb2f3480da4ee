"""Helpers for OpenAI chat messages, shared by the engine (rendering) and the gateway (matching)."""

from __future__ import annotations

import json
from typing import Any

from clawr1.core.types import InvalidRequestError


def text_of(content: Any, where: str) -> str:
    """OpenAI content (a string, null, or an array of parts) as plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequestError(f"{where}: content part of type {kind!r} is not supported by a text model", where)
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise InvalidRequestError(f"{where}: content must be a string or an array of parts", where)


def arguments_value(arguments: Any) -> Any:
    """Templates expect arguments as a mapping; OpenAI sends a JSON string."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):  # not JSON we can read (or nested too deep to): as sent
            return arguments
    return arguments


def arguments_object(arguments: Any) -> dict[str, Any]:
    """Arguments as a JSON object, as APIs that require one take them (Anthropic's `input`): a
    value that is none (a model's odd output: text, a list) is wrapped as `{"arguments": value}`."""
    value = arguments_value(arguments)
    return value if isinstance(value, dict) else {"arguments": value}


def format_tool_call(name: str, arguments: Any) -> str:
    """One tool call as the engine's convention writes it for models without native tools (the
    Hermes/Qwen format): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments_value(arguments)}) + "</tool_call>"
