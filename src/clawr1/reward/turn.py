"""Reading a turn: the task (last user request), and the next state as role-tagged, clipped text."""

from __future__ import annotations

from clawr1.core.messages import text_of
from clawr1.reward.types import Message


def task_of(context: list[Message]) -> str:
    """The task context: the last user message of the turn's request ('' if there is none)."""
    for i in range(len(context) - 1, -1, -1):
        if context[i].get("role") == "user":
            return text_of(context[i].get("content"), f"context[{i}].content")
    return ""


def role_of(message: Message) -> str:
    """`user`, or `tool (name)` when the tool message names its tool."""
    role = str(message.get("role", "user"))
    name = message.get("name")
    return f"{role} ({name})" if role == "tool" and name else role


def message_text(message: Message, where: str = "next_state") -> str:
    return text_of(message.get("content"), where)


def clip(text: str, limit: int) -> str:
    """Keep head and tail of a long text: errors sit at the end of tool output, the ask at the start
    of a user message, so both ends carry the signal and the middle is what can go."""
    text = text.strip()
    if len(text) <= limit:
        return text
    head = limit // 3
    return text[:head].rstrip() + "\n[...]\n" + text[len(text) - (limit - head):].lstrip()


def next_state_text(next_state: list[Message], limit: int = 600) -> str:
    """The next state as `role: text` blocks, each clipped so the whole stays near `limit` chars."""
    if not next_state:
        return "(nothing)"
    each = max(120, limit // len(next_state))
    blocks = []
    for i, message in enumerate(next_state):
        text = clip(message_text(message, f"next_state[{i}].content"), each) or "(empty)"
        blocks.append(f"{role_of(message)}: {text}")
    return "\n".join(blocks)
