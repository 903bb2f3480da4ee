"""What the translated API surfaces share: Anthropic Messages (`anthropic.py`) and OpenAI Responses
(`responses.py`) are wire formats only. Each request is turned into OpenAI chat messages and tools
and then takes exactly chat's path (`pipeline.py`): render, admit and generate, resolve the session
from those messages, the path and the X-Session-* headers, record the step token for token, teach
the history matcher the reply. So a session's steps look the same in the pool whichever API the
agent speaks, and a conversation continues across turns by history matching as it does for chat.

One generation per request (neither API has `n`).
"""

from __future__ import annotations

from typing import Any

from clawr1.core.types import SamplingParams
from clawr1.gateway.memory import rendered
from clawr1.gateway.pipeline import Job
from clawr1.gateway.service import Caller, Gateway
from clawr1.gateway.sessions import affinity_key


def chat_job(gw: Gateway, req: Any, caller: Caller, reply_id: str, messages: list[dict[str, Any]],
             tools: list[dict[str, Any]] | None, sampling: SamplingParams, headers: dict[str, str],
             path_ids: tuple[str, str] | None) -> Job:
    """A translated request as chat would run it (a bad conversation raises here, before admission)."""
    prompt, recall = rendered(gw, caller, headers, path_ids, req, messages, tools)  # the user's memory added
    return Job(req, reply_id, [prompt], [sampling], messages, tools, bool(req.stream), watch_tools=tools is not None,
               affinity=affinity_key(caller.tenant, messages, headers, path_ids, caller.session_id), recall=recall)


def text_content(texts: list[str]) -> str | list[dict[str, str]] | None:
    """Chat `content` for a message's text blocks: a string for one block, OpenAI text parts for
    several (rendered joined, as chat renders parts), None for none."""
    if not texts:
        return None
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": t} for t in texts]
