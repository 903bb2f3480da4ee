"""Resolve every request to (tenant, session, prompt id, turn index, turn type), by the first rule
that applies (the session protocol of ../shared/ARCHITECTURE.md): URL path ids, `X-Session-Id` headers, a per-session API key, then
automatic history matching. Turn indices are handed out at arrival under a lock, so interleaved
requests of one session keep their order; a session this process has not seen yet (a restart, a
header id from yesterday) resumes after the pool's last stored turn.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from clawr1.gateway.ids import new_id
from clawr1.gateway.matcher import Hashed, HistoryMatcher, hashed, is_summariser_call

SESSION_KEY_PREFIX = "sk-clawr1-s-"  # per-session keys are recognisable, so an unknown one is refused
# An agent's key for one session (`POST /v1/sessions`): it serves the session and cannot rate it (no
# feedback, no close, no `X-Session-Done`). The prefix says so, and the pool keeps the hash of the
# whole key, so no one can turn one kind into the other.
AGENT_KEY_PREFIX = "sk-clawr1-a-"
SESSION_KEY_PREFIXES = (SESSION_KEY_PREFIX, AGENT_KEY_PREFIX)
UNKNOWN_SESSION_KEY = "unknown session key"  # the 401's message: the front remembers such keys


@dataclass(frozen=True)
class Turn:
    tenant: str
    session_id: str
    prompt_id: str
    turn_index: int
    turn_type: Literal["main", "side"]
    done: bool  # X-Session-Done: close the session once this turn is stored
    how: Literal["path", "header", "key", "matched", "edited", "compacted", "new", "unmatched"]
    # The request messages' hashes when history matching computed them: `record` reuses them, so
    # a request's messages are hashed once.
    hashes: Hashed | None = dataclasses.field(default=None, compare=False, repr=False)


class SessionResolver:
    def __init__(self, last_turn: Callable[[str, str], int | None], owns: Callable[[str], bool] | None = None):
        """`last_turn(session_id, tenant)`: the highest stored turn index of a session, or None.
        `owns(session_id)`: with several gateway processes, whether an id routes to this one; the
        sessions it opens get such ids (`gateway/dispatch.py`)."""
        self.matcher = HistoryMatcher()
        self.owns = owns
        self._last_turn = last_turn
        self._next_turn: dict[tuple[str, str], int] = {}
        self._seen: dict[tuple[str, str], float] = {}  # last request arrival (monotonic) per session
        # Turns by (tenant, how their session was found): /metrics and the dashboard show them.
        self.resolved: collections.Counter[tuple[str, str]] = collections.Counter()
        self._lock = threading.Lock()

    def resolve(self, tenant: str, messages: list[dict[str, Any]], headers: dict[str, str],
                path_ids: tuple[str, str] | None = None, bound_session: str | None = None) -> Turn:
        """`identify` then `number`, reading the pool's last turn in this thread when needed (the
        gateway does that read off its event loop instead: `Gateway.resolve`)."""
        who = self.identify(tenant, messages, headers, path_ids, bound_session)
        last = self._last_turn(who.session_id, tenant) if self.needs_lookup(who) else None
        return self.number(who, last)

    def identify(self, tenant: str, messages: list[dict[str, Any]], headers: dict[str, str],
                 path_ids: tuple[str, str] | None = None, bound_session: str | None = None) -> Turn:
        """Which session and prompt a request belongs to, by the first rule that applies; the
        returned turn's index is not assigned yet (-1)."""
        turn_type = headers.get("x-turn-type", "main").strip().lower()
        if turn_type not in ("main", "side"):
            turn_type = "main"
        if is_summariser_call(messages):
            turn_type = "side"  # the agent compacting its history: recorded, never trained
        done = headers.get("x-session-done", "").strip().lower() in ("1", "true", "yes")
        how: Literal["path", "header", "key", "matched", "edited", "compacted", "new", "unmatched"]
        named = named_session(headers, path_ids, bound_session)
        hashes = None
        if named is not None:
            session_id, prompt_id, how = named
        else:
            hashes = hashed(messages)  # outside the lock: the costly part
            with self._lock:
                match = self.matcher.find(tenant, messages, hashes) if messages else None
            if match is None:
                # A request with a reply in it continued a conversation no open session holds: a
                # client's edit not recognised, a session closed idle, or history from elsewhere.
                unmatched = any(m.get("role") == "assistant" for m in messages)
                session_id, how = self._new_id(), ("unmatched" if unmatched else "new")
            else:
                session_id = match.session_id
                how = "compacted" if match.compacted else "edited" if match.edited else "matched"
            prompt_id = session_id
        return Turn(tenant, session_id, prompt_id, -1, turn_type, done, how, hashes)  # type: ignore[arg-type]

    def _new_id(self) -> str:
        session_id = new_id("s-")
        while self.owns is not None and not self.owns(session_id):  # n tries on average with n processes
            session_id = new_id("s-")
        return session_id

    def needs_lookup(self, who: Turn) -> bool:
        """A session this process has not numbered yet (a restart, a header id from yesterday)
        resumes after the pool's last stored turn."""
        return who.how not in ("new", "unmatched") and (who.tenant, who.session_id) not in self._next_turn

    def number(self, who: Turn, last: int | None) -> Turn:
        """Hand out the next turn index at arrival, so interleaved requests keep their order;
        `last` is the pool's last stored turn for a session not numbered here yet."""
        key = (who.tenant, who.session_id)
        with self._lock:
            index = self._next_turn.get(key)
            if index is None:
                index = 0 if last is None else last + 1
            self._next_turn[key] = index + 1
            self._seen[key] = time.monotonic()
            self.resolved[who.tenant, who.how] += 1
        # A turn's samples are alternatives to one prompt (a GRPO group) only when the client says
        # so (path ids: white-box rollouts of one task) or they are the `n` choices of one request.
        # The turns of an online session answer different prompts: one group each, or GRPO would
        # normalise them together (equal rewards -> zero advantage).
        prompt_id = who.prompt_id if who.how == "path" else f"{who.session_id}/t{index}"
        # Built, not `dataclasses.replace` (which inspects the fields on every call).
        return Turn(who.tenant, who.session_id, prompt_id, index, who.turn_type, who.done, who.how, who.hashes)

    def record(self, turn: Turn, messages: list[dict[str, Any]], reply: dict[str, Any]) -> None:
        """After a main turn is served: its next request will start with these messages + reply.
        After an agent's summarising call: the summary it got names the session it compacts."""
        if turn.turn_type == "main" and messages:
            with self._lock:
                if (turn.tenant, turn.session_id) in self._next_turn:  # not closed meanwhile
                    self.matcher.record(turn.tenant, turn.session_id, messages, reply, turn.hashes)
        elif is_summariser_call(messages):
            with self._lock:
                self.matcher.record_summary(turn.tenant, messages, reply)

    def summarised(self, tenant: str, messages: list[dict[str, Any]]) -> str | None:
        """The open session an agent's summarising call summarises, if this process holds it."""
        with self._lock:
            return self.matcher.summarised(tenant, messages)

    def restore(self, tenant: str, session_id: str, messages: list[dict[str, Any]], reply: dict[str, Any],
                next_turn: int) -> None:
        """Re-learn an open session's last main turn from the pool (after a restart)."""
        with self._lock:
            self._next_turn.setdefault((tenant, session_id), next_turn)
            self.matcher.record(tenant, session_id, messages, reply)

    def forget(self, tenant: str, session_id: str) -> None:
        """A closed session: its transcript no longer matches, its counters go (no state grows
        forever). A later request naming it resumes numbering from the pool."""
        with self._lock:
            self.matcher.forget(tenant, session_id)
            self._next_turn.pop((tenant, session_id), None)
            self._seen.pop((tenant, session_id), None)

    def turns_by_how(self, tenant: str | None = None) -> dict[str, int]:
        """How the sessions of this process's turns were found (of one tenant, or all)."""
        with self._lock:
            counts = list(self.resolved.items())
        out: collections.Counter[str] = collections.Counter()
        for (owner, how), n in counts:
            if tenant is None or owner == tenant:
                out[how] += n
        return dict(sorted(out.items()))

    def active_since(self, since_monotonic: float) -> set[tuple[str, str]]:
        """Sessions with a request arrived after `since`: in use, even if no step is stored yet."""
        with self._lock:
            return {key for key, seen in self._seen.items() if seen >= since_monotonic}


def new_session_key(rates: bool = True) -> tuple[str, str]:
    """A fresh per-session API key and the sha256 the pool stores instead of it (`rates` False: an
    agent's key, `AGENT_KEY_PREFIX`)."""
    key = (SESSION_KEY_PREFIX if rates else AGENT_KEY_PREFIX) + secrets.token_urlsafe(24)
    return key, hash_key(key)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def named_session(headers: dict[str, str], path_ids: tuple[str, str] | None,
                  bound_session: str | None) -> tuple[str, str, Literal["path", "header", "key"]] | None:
    """(session id, prompt id, how) when the request names its session, by the protocol's
    precedence (the one place it is written): URL path ids, then `X-Session-Id`, then a
    per-session API key. None: history matching decides. (A request with a per-session key that
    names another session never gets here: `pipeline.handle` answers it 403.)"""
    if path_ids is not None:
        return path_ids[0], path_ids[1], "path"
    if headers.get("x-session-id"):
        return headers["x-session-id"], headers["x-session-id"], "header"
    if bound_session is not None:
        return bound_session, bound_session, "key"
    return None


def affinity_key(tenant: str, messages: list[dict[str, Any]], headers: dict[str, str],
                 path_ids: tuple[str, str] | None, bound_session: str | None = None) -> str:
    """Which engine replica a request should go to, known before the session is resolved: the
    session it names (`named_session`), else the conversation's first user message, which every
    later turn of a stock client's conversation repeats. Only routing depends on it (two
    conversations sharing a key just share a replica), so it hashes that one message, not the
    whole opening: an agent's system prompt can be 40k characters on every request."""
    named = named_session(headers, path_ids, bound_session)
    if named is not None:
        return f"{tenant}/{named[0]}"
    first = next((m.get("content") for m in messages if m.get("role") == "user"), None)
    text = first if isinstance(first, str) else json.dumps(first, default=str)
    return tenant + "/" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
