"""What of a reply a stream may send yet (`safe_text`) and what is left to send when it ends
(`tail`): with tools offered, text that may still become a tool call is held back, so that a
streamed reply says exactly what the plain reply says."""

from __future__ import annotations

from clawr1.core.types import Generation, ParsedCompletion
from clawr1.engine.chat import could_be_bare_call

TOOL_OPEN = "<tool_call>"


def safe_text(visible: str, sent: str, watch_tools: bool) -> str:
    """New content that is safe to stream: with tools on, nothing from a `<tool_call>` on (and no
    suffix that could start one, nor trailing whitespace), and nothing of a reply that may still be
    a bare JSON call (`engine/chat.py`), since it may turn into a structured tool call at the end."""
    end = len(visible)
    if watch_tools and not sent and could_be_bare_call(visible):
        return ""
    if watch_tools:
        at = visible.find(TOOL_OPEN)
        if at >= 0:
            end = at
        else:
            for n in range(min(len(TOOL_OPEN) - 1, end), 0, -1):
                if visible.endswith(TOOL_OPEN[:n]):
                    end -= n
                    break
        # Whitespace before a call is stripped from the reply's content (`ChatFormat.parse`): it is
        # held until text follows, so that a stream says what the plain reply says.
        while end > len(sent) and visible[end - 1].isspace():
            end -= 1
    return visible[len(sent):end] if end > len(sent) else ""


def tail(gen: Generation, parsed: ParsedCompletion, sent: str) -> str:
    """Content not streamed yet when the generation ended: a held-back tool-call prefix that turned
    out to be text, text before a stop sequence, or, when the reply became tool calls, text the
    model wrote after them (the plain reply's content keeps it). Streamed or not, a reply says the
    same; a plain content that does not continue what was streamed (whitespace before the text,
    which it strips) adds nothing."""
    if not parsed.tool_calls:
        return gen.content[len(sent):] if len(gen.content) > len(sent) else ""
    content = parsed.content or ""
    return content[len(sent):] if content.startswith(sent) else ""
