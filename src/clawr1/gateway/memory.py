"""The gateway's side of the per-user memory (`clawr1/core/memory.py`): who the user of a request
is, and the user's active entries added to its system prompt before the chat template renders.

Entries live in the pool (the judge's and feedback's hints make them, in the transaction that
stores the hint, whichever process that runs in). This process keeps the active ones in memory, per
(tenant, user), each user's prompt text made once when they change, and reads the pool's changes
every `memory.refresh_s` (only the rows changed since its last read). A request pays a few dict
lookups: nothing is read from the pool on a request's path.

Who the user is (`identity`), within the caller's tenant, by the first rule that applies:
1. a per-session key: its session (the key speaks for that session only, and names no one else);
2. `X-User-Id`, then the request body's own end-user id (OpenAI's `user` or its successor
   `safety_identifier`, in chat and Responses requests; Anthropic's `metadata.user_id`):
   `user:<id>`. This is what carries across a user's sessions: several users behind one agent
   key (the demo's, a multi-user app) each name themselves;
3. `memory.fallback`: the session the request names (`session:<id>`: path ids, `X-Session-Id`),
   the tenant's one user (`tenant`), or nobody.
A request with no user neither gets memory nor makes any. `X-Memory: off` (or `memory.enabled`,
`memory.off_tenants`, `clawr1 memory off`) turns both off.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from clawr1.core import memory as rules
from clawr1.gateway.errors import APIError
from clawr1.gateway.sessions import named_session

if TYPE_CHECKING:
    from clawr1.core.config import Config
    from clawr1.datapool.base import DataPool
    from clawr1.engine.base import Engine

log = logging.getLogger(__name__)
OFF = frozenset({"off", "false", "0", "no", "none"})
USER_ID = re.compile(r"[^\x00-\x1f\x7f]{1,256}")  # as it is stored and shown (escaped) on the dashboard


class Recall(NamedTuple):
    """A request's memory: whose it is, the messages as served (memory added) and what the step
    records of it (`core.memory.record`)."""

    user: str
    messages: list[dict[str, Any]]
    record: dict[str, Any]

    @property
    def entries(self) -> list[dict[str, Any]]:
        return self.record.get("entries", [])


@dataclass(frozen=True)
class _View:
    """One user's prompt memory, made when their entries change."""

    entries: list[tuple[int, str]]  # (id, text), oldest first
    text: str  # the block added to the system prompt


def special_texts(tokenizer: Any) -> frozenset[str]:
    """The texts of a tokenizer's special and added tokens (`<|im_end|>`, `<tool_call>`, ...): an
    entry holding one would be tokenized as that token."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        found.add(getattr(token, "content", str(token)))
    return frozenset(t for t in found if isinstance(t, str) and len(t) > 1 and not t.isspace())


class Memory:
    """The active entries of every user, kept current from the pool, and their recall per request."""

    def __init__(self, config: Config, pool: DataPool, engine: Engine, on_recall: Any = None):
        self.config, self.pool = config.memory, pool
        self.enabled = config.memory.enabled
        self.off_tenants = frozenset(config.memory.off_tenants)
        self.specials = special_texts(getattr(engine, "tokenizer", None))
        self.on_recall = on_recall  # called with the number of entries a prompt got (a metric)
        self._entries: dict[tuple[str, str], dict[int, tuple[float, str]]] = {}  # id -> (created_at, text)
        self._views: dict[tuple[str, str], _View] = {}
        self._off: set[tuple[str, str]] = set()  # (tenant, user), (tenant, "") for a whole tenant
        self._revs = (0, 0)
        self._lock = threading.Lock()  # one refresh at a time (a request only reads the dicts)
        self.unsafe: dict[int, str] = {}  # entries never added: id -> the served tokenizer's token they hold

    # ---- a request ---------------------------------------------------------------------------
    def identity(self, tenant: str, bound_session: str | None, headers: dict[str, str],
                 path_ids: tuple[str, str] | None, req: Any) -> str | None:
        """Who the request's user is (see the module's docstring), or None."""
        if bound_session is not None:
            return f"session:{bound_session}"
        named = headers.get("x-user-id")
        if named is not None:
            if not USER_ID.fullmatch(named.strip()):
                raise APIError(400, "X-User-Id must be 1-256 characters without control characters",
                               param="X-User-Id", code="invalid_value")
            return "user:" + named.strip()
        metadata = getattr(req, "metadata", None)
        for given in (getattr(req, "user", None), getattr(req, "safety_identifier", None),
                      metadata.get("user_id") if isinstance(metadata, dict) else None):
            if isinstance(given, str) and USER_ID.fullmatch(given.strip()):  # else (an odd one): the next
                return "user:" + given.strip()
        fallback = self.config.fallback
        if fallback == "session":
            session = named_session(headers, path_ids, None)
            return None if session is None else f"session:{session[0]}"
        return "tenant" if fallback == "tenant" else None

    def recall(self, tenant: str, bound_session: str | None, headers: dict[str, str],
               path_ids: tuple[str, str] | None, req: Any, messages: list[dict[str, Any]]) -> Recall | None:
        """The request's memory: None when it has no user or the memory is off for it; else its
        user's active entries added to its system prompt (none yet: only the user, recorded so a
        correction of this turn makes an entry of theirs)."""
        if not self.enabled or tenant in self.off_tenants:
            return None
        flag = headers.get("x-memory")
        if flag is not None and flag.strip().lower() in OFF:
            return None
        user = self.identity(tenant, bound_session, headers, path_ids, req)
        if user is None:
            return None
        if self._off and ((tenant, "") in self._off or (tenant, user) in self._off):
            return None
        view = self._views.get((tenant, user))
        if view is None or not messages:
            return Recall(user, messages, {"user": user})
        served, added, at = rules.add_to(messages, view.text)
        if self.on_recall is not None:
            self.on_recall(len(view.entries))
        return Recall(user, served, rules.record(user, view.entries, added, at))

    # ---- keeping current ---------------------------------------------------------------------
    def refresh(self) -> int:
        """Read the pool's changes since the last read (blocking: run it in a thread); returns how
        many rows changed."""
        with self._lock:
            changes = self.pool.memory_changes(*self._revs)
            touched: set[tuple[str, str]] = set()
            for row in changes["entries"]:
                key = (row["tenant"], row["user_id"])
                held = self._entries.setdefault(key, {})
                if row["status"] == "active":
                    held[row["id"]] = (row["created_at"], row["text"])
                else:
                    held.pop(row["id"], None)
                touched.add(key)
            for row in changes["switches"]:
                key = (row["tenant"], row["user_id"])
                if row["off"]:
                    self._off.add(key)
                else:
                    self._off.discard(key)
            for key in touched:
                self._rebuild(key)
            self._revs = (max(self._revs[0], changes["entries_rev"]), max(self._revs[1], changes["switches_rev"]))
            return len(changes["entries"]) + len(changes["switches"])

    def _rebuild(self, key: tuple[str, str]) -> None:
        """A user's prompt memory: the newest entries that fit `max_entries` and `max_prompt_chars`,
        without any that hold a token of the served tokenizer, oldest first."""
        held = self._entries.get(key) or {}
        if not held:
            self._entries.pop(key, None)
            self._views.pop(key, None)
            return
        chosen: list[tuple[int, str]] = []
        size, seen = len(rules.HEADER), set()
        for entry_id, (_, text) in sorted(held.items(), key=lambda item: (item[1][0], item[0]), reverse=True):
            token = rules.unsafe(text, self.specials)
            if token is not None:
                if entry_id not in self.unsafe:
                    log.warning("memory entry %d is never added to a prompt: it holds %r, a token of the served "
                                "model", entry_id, token)
                self.unsafe[entry_id] = token
                continue
            if rules.normal(text) in seen:
                continue
            if len(chosen) >= self.config.max_entries or size + 3 + len(text) > self.config.max_prompt_chars:
                break
            chosen.append((entry_id, text))
            seen.add(rules.normal(text))
            size += 3 + len(text)  # "\n- " and the entry
        chosen.reverse()
        if chosen:
            self._views[key] = _View(chosen, rules.block([t for _, t in chosen]))
        else:
            self._views.pop(key, None)

    def active(self) -> int:
        """Active entries held (the gauge; read by the metrics scrape while `refresh` may change them
        in a worker thread: `list` copies the values in one step under the GIL, where a generator
        over the live view could see it change size; no lock, which `refresh` holds across a pool read)."""
        return sum(len(held) for held in list(self._entries.values()))

    async def watch(self) -> None:
        """Keep current (`memory.refresh_s`); a failed read is logged and tried again."""
        while True:
            await asyncio.sleep(self.config.refresh_s)
            try:
                await asyncio.to_thread(self.refresh)
            except Exception:  # a busy database must not end the watcher: the next round retries
                log.exception("reading the memory's changes failed; retrying")


def rendered(gw: Any, caller: Any, headers: dict[str, str], path_ids: tuple[str, str] | None, req: Any,
             messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> tuple[list[int], Recall | None]:
    """A chat request's prompt ids with its user's memory in the system prompt, and its `Recall`.
    Memory never makes a request fail: a prompt it would push past the context is served without."""
    recall = gw.memory.recall(caller.tenant, caller.session_id, headers, path_ids, req, messages)
    if recall is None or not recall.entries:
        return gw.engine.render(messages, tools), recall
    prompt = gw.engine.render(recall.messages, tools)
    if len(prompt) >= gw.engine.max_context:
        return gw.engine.render(messages, tools), Recall(recall.user, messages, {"user": recall.user})
    return prompt, recall
