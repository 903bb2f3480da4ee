"""Tool plumbing shared by the envs: schema builders, argument validation, safe workspace paths.

A bad call (unknown tool, arguments that are not JSON, a missing field, a wrong type) is the
agent's mistake, not ours: it comes back as an "Error: ..." tool message, which is the next state
the judge sees, so the agent can learn from it. Only failures of the environment itself raise.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from clawr1.envs.base import Env

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,),
}


class ToolError(Exception):
    """A bad tool call; its message becomes the "Error: ..." tool message."""


# How `parse_arguments` words a call's form (not its substance: a calculator's "division by zero"
# is neither), so a curve can count what a model gets wrong about calling (`call_mistake`).
UNKNOWN_TOOL = "unknown tool "
_ARGUMENT_ERROR = re.compile(r"arguments of [\w.-]+ |[\w.-]+ (is missing required|got unknown) argument|[\w.-]+: argument '")


def call_mistake(message: str) -> str | None:
    """'wrong_tool' or 'bad_arguments' when a tool message is `parse_arguments`' error about the
    call's form; None otherwise (a result, or the tool's own error about the substance)."""
    if not message.startswith("Error: "):
        return None
    body = message.removeprefix("Error: ")
    if body.startswith(UNKNOWN_TOOL):
        return "wrong_tool"
    return "bad_arguments" if _ARGUMENT_ERROR.match(body) else None


def function_tool(name: str, description: str, properties: dict[str, dict[str, Any]] | None = None,
                  required: list[str] | None = None) -> dict[str, Any]:
    """An OpenAI function tool with a closed object schema (unknown fields are errors)."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties or {}, "required": required or [],
                       "additionalProperties": False}}}


def parse_arguments(tools: list[dict[str, Any]], name: str, arguments: str | dict[str, Any] | None) -> dict[str, Any]:
    """The validated arguments of a call to `name`, with schema defaults filled in.

    Checks what small models get wrong: the tool exists, the arguments are a JSON object, required
    fields are present, no unknown fields, JSON types (a bool is not a number), enums and numeric
    bounds. Raises `ToolError` with a message meant for the agent.
    """
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools}
    if name not in schemas:
        raise ToolError(f"{UNKNOWN_TOOL}{name!r}; available tools: {', '.join(sorted(schemas))}")
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise ToolError(f"arguments of {name} are not valid JSON ({err.msg} at position {err.pos})") from None
    if not isinstance(arguments, dict):
        raise ToolError(f"arguments of {name} must be a JSON object, got {type(arguments).__name__}")
    schema = schemas[name]
    props: dict[str, dict[str, Any]] = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in arguments]
    if missing:
        raise ToolError(f"{name} is missing required argument(s): {', '.join(missing)}")
    unknown = [k for k in arguments if k not in props]
    if unknown and schema.get("additionalProperties", True) is False:
        raise ToolError(f"{name} got unknown argument(s): {', '.join(unknown)}; it takes: {', '.join(props)}")
    out = {k: spec["default"] for k, spec in props.items() if "default" in spec}
    for key, value in arguments.items():
        _check_value(name, key, value, props.get(key, {}))
        out[key] = value
    return out


def _check_value(tool: str, key: str, value: Any, spec: dict[str, Any]) -> None:
    kind = spec.get("type")
    if kind is not None:
        ok = isinstance(value, _JSON_TYPES[kind]) and not (kind in ("integer", "number") and isinstance(value, bool))
        if not ok:
            raise ToolError(f"{tool}: argument {key!r} must be of type {kind}, got {type(value).__name__}")
    if "enum" in spec and value not in spec["enum"]:
        raise ToolError(f"{tool}: argument {key!r} must be one of {spec['enum']}")
    if "minimum" in spec and value < spec["minimum"]:
        raise ToolError(f"{tool}: argument {key!r} must be >= {spec['minimum']}")
    if "maximum" in spec and value > spec["maximum"]:
        raise ToolError(f"{tool}: argument {key!r} must be <= {spec['maximum']}")
    if "maxLength" in spec and len(value) > spec["maxLength"]:
        raise ToolError(f"{tool}: argument {key!r} is longer than {spec['maxLength']} characters")


class ToolEnv(Env):
    """An env whose tool `x` is the method `tool_x(**arguments)`: `call` validates the arguments
    against `tools()` and turns a `ToolError` (from validation or from the tool) into the
    "Error: ..." message. Any other exception is a bug in the env and propagates."""

    def call(self, name: str, arguments: str | dict[str, Any]) -> str:
        try:
            args = parse_arguments(self.tools(), name, arguments)
            return getattr(self, f"tool_{name}")(**args)
        except ToolError as err:
            return f"Error: {err}"


def inside(workdir: Path, rel: str) -> Path:
    """`rel` resolved inside `workdir` (symlinks followed). Raises `ToolError` for a path that
    leaves it, so host-side file tools never read or write outside the workspace, even through a
    symlink a sandboxed command planted."""
    root = workdir.resolve()
    path = (root / rel).resolve()
    if path != root and not path.is_relative_to(root):
        raise ToolError(f"path {rel!r} is outside the workspace")
    return path


def write_files(workdir: Path, files: dict[str, str]) -> None:
    """Write a task's `files` (relative path -> text) into the workspace."""
    for rel, text in files.items():
        path = inside(workdir, rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def read_text(workdir: Path, rel: str) -> str | None:
    """A workspace file's text, or None when it is missing, not a regular file, or outside."""
    try:
        path = inside(workdir, rel)
    except ToolError:
        return None
    return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else None
