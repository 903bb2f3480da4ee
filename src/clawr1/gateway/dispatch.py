"""Which of `gateway.workers` gateway processes a request belongs to, decided from the request alone.

Each worker keeps its own sessions (history matcher, turn numbering), so every request of a
session must reach the same worker. The front process (`entrypoints/front.py`) routes by the first
of these that the request has:

1. the session its URL names (`/{session}/{prompt}/v1/...`, `/sessions/{session}/v1/...`,
   `/rollout/{r}/attempt/{a}/...`, `/v1/sessions/{session}/close`, AReaL's `/{session}/...`), its
   `X-Session-Id` header or `session_id` body field: the worker `owner(session id)`;
2. a per-session API key: the worker `owner(key)` (every request with that key goes there);
3. the conversation: the worker `owner(caller key + first user message)`, which a stock client
   repeats every turn. A worker that opens a new session for such a request names it so that
   `owner(session id)` is that same worker (`SessionResolver(owns=...)`), so rule 1 finds it too
   (closing a matched session by its id, feedback, a restart's restore).
4. a compaction, whose first user message no longer is the conversation's: the agent's
   summarising call (its transcript as one text) and the compacted request (its first user message
   is the summary). `Route.ask`: the front asks the workers which one holds the session
   (`/internal/match`), and uses rule 3 when none does (the request then opens a new session, as
   it would with one process);
5. nothing of the above (models, metrics, dashboard, admin, a completion without a session): the
   leader, worker 0, except completions, which spread round robin (each is a session of its own).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

from clawr1.gateway.matcher import SUMMARISER_PROMPTS, SUMMARY_OPENINGS
from clawr1.gateway.sessions import SESSION_KEY_PREFIXES

# First path segments that are routes of their own, never a session id (`/{session}/...` routes).
FIXED = frozenset({"v1", "admin", "dashboard", "metrics", "healthz", "rl", "chat", "completions", "responses",
                   "openapi.json", "docs", "redoc", "favicon.ico", "internal"})
SPREAD = ("/v1/completions", "/completions")  # sessionless work that any worker may take
KEY_HEADER = "x-clawr1-internal"  # the front's key, on its `/internal/match` questions to the workers
PATH_HEADER = "x-clawr1-path"  # with them: the path the client asked for (which wire format the body is)


def key_digest(internal_key: str, key: str) -> str:
    """What a front holds of an agent or admin key: its HMAC under the run's internal key."""
    return hmac.new(internal_key.encode(), key.encode(), hashlib.sha256).hexdigest()


def owner(key: str, workers: int) -> int:
    """The worker that owns `key` (a session id, a session key, a conversation)."""
    if workers == 1:
        return 0
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % workers


def path_session(path: str) -> str | None:
    """The session id a URL names, the way the gateway's routes read it (tests check every route).
    The shapes with a prompt id come first: a trajectory may be called `chat` or `rl`."""
    seg = path.strip("/").split("/")
    if len(seg) < 2 or not seg[0]:
        return None
    if seg[0] == "sessions" and len(seg) > 2:
        return seg[1]  # rLLM: /sessions/{id}/v1/...
    if seg[0] == "rollout" and len(seg) > 4 and seg[2] == "attempt":
        return f"{seg[1]}:{seg[3]}"  # Agent Lightning: /rollout/{r}/attempt/{a}/...
    if seg[0] == "v1":  # fixed routes and /v1/sessions/{id}/close (a trajectory called "v1": the one id not routed by)
        return seg[2] if len(seg) > 3 and seg[1] == "sessions" else None
    if (len(seg) > 3 and seg[2] == "v1") or seg[2:] in (["chat", "completions"], ["completions"], ["responses"]):
        return seg[0]  # /{session}/{prompt}/v1/..., /{session}/{prompt}/chat/completions, ...
    if seg[0] in FIXED:
        return None
    return seg[0]  # AReaL's /{session}/chat/completions, /{session}/completions, /{session}/rl/...


def bearer(headers: Any) -> str:
    """The caller's key as the gateway reads it (Anthropic's `x-api-key`, else `Authorization: Bearer`)."""
    auth = headers.get("authorization", "")
    return headers.get("x-api-key", "").strip() or (auth[7:].strip() if auth.startswith("Bearer ") else "")


def first_user_text(body: Any) -> str | None:
    """The first user message of a chat, Anthropic or Responses body, as its text (parts joined,
    so a client moving its cache marker off the message from one turn to the next keeps its
    route); None when it has none (a completion, a malformed body: the worker answers those)."""
    if not isinstance(body, dict):
        return None
    items = body.get("messages")
    if items is None:
        items = body.get("input")
        if isinstance(items, str):
            return items
    if not isinstance(items, list):
        return None
    for item in items:
        if isinstance(item, dict) and item.get("role") == "user":
            return _text(item.get("content"))
    return None


def _text(content: Any) -> str:
    """The text of a string or of a list of parts (`text` fields only: images, cache markers and
    other fields say nothing about which conversation this is)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def summarising(body: Any) -> bool:
    """An agent's own summarising call (`matcher.is_summariser_call`): its system prompt, in a chat
    body's first message, an Anthropic body's `system` or a Responses body's `instructions`."""
    if not isinstance(body, dict):
        return False
    system = body.get("system", body.get("instructions"))
    messages = body.get("messages")
    if system is None and isinstance(messages, list) and messages and isinstance(messages[0], dict) \
            and messages[0].get("role") in ("system", "developer"):
        system = messages[0].get("content")
    return _text(system).lstrip().startswith(SUMMARISER_PROMPTS)


@dataclass(frozen=True)
class Route:
    worker: int  # where the request goes (for `ask`: where it goes when no worker holds its session)
    ask: bool = False  # a compacted conversation: ask the workers which one holds its session first


def route(method: str, path: str, headers: Any, body: Any, workers: int, turn: int) -> Route:
    """Where a request goes. `headers` lower-cased keys; `body` the parsed JSON (None when it is
    not JSON); `turn` a counter for round robin."""
    named = path_session(path) or headers.get("x-session-id")
    if not named and isinstance(body, dict) and isinstance(body.get("session_id"), (str, int)):
        named = str(body["session_id"])
    if named:
        return Route(owner(str(named), workers))
    key = bearer(headers)
    if key.startswith(SESSION_KEY_PREFIXES):
        return Route(owner(key, workers))
    text = first_user_text(body) if method == "POST" else None
    if text is not None:
        to = owner(key + "\n" + text, workers)
        return Route(to, ask=workers > 1 and (text.lstrip().startswith(SUMMARY_OPENINGS) or summarising(body)))
    if path in SPREAD:
        return Route(turn % workers)
    return Route(0)
