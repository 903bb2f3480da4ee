"""What of a generation's text may be streamed yet, shared by the local and the remote engines.

Text is held back while it could still be the start of a stop sequence (which OpenAI never returns)
or ends in half a UTF-8 character; when the generation ends, the rest of its content is flushed.
"""

from __future__ import annotations

from clawr1.core.types import Generation


def visible_delta(text: str, emitted: int, stops: tuple[str, ...]) -> tuple[str, int]:
    """(new text safe to show, characters shown so far) for the decoded `text`."""
    end = len(text.rstrip("\ufffd"))
    for stop in stops:
        for n in range(min(len(stop) - 1, end), 0, -1):
            if text[end - n:end] == stop[:n]:
                end -= n
                break
    delta = text[emitted:end] if end > emitted else ""
    return delta, max(emitted, end)


def flush(gen: Generation, emitted: int) -> tuple[str, int]:
    """At the end: the content not shown yet (cut at a matched stop sequence)."""
    content = gen.content
    return content[emitted:], len(content)
