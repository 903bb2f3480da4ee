"""Resolve every request to (tenant, session, prompt id, turn index, turn type), by the first rule
that applies (ARCHITECTURE.md): URL path ids, then `X-Session-Id` headers, then automatic history
matching. Turn indices are handed out at arrival under a lock, so interleaved requests of one
session keep their order.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from clawr1.gateway.matcher import HistoryMatcher


@dataclass(frozen=True)
class Turn:
    tenant: str
    session_id: str
    prompt_id: str
    turn_index: int
    turn_type: Literal["main", "side"]
    done: bool
    how: Literal["path", "header", "matched", "new"]


class SessionResolver:
    def __init__(self) -> None:
        self.matcher = HistoryMatcher()
        self._next_turn: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def resolve(self, tenant: str, messages: list[dict[str, Any]], headers: dict[str, str],
                path_ids: tuple[str, str] | None = None) -> Turn:
        turn_type = headers.get("x-turn-type", "main").strip().lower()
        if turn_type not in ("main", "side"):
            turn_type = "main"
        done = headers.get("x-session-done", "").strip().lower() in ("1", "true", "yes")
        with self._lock:
            if path_ids is not None:
                session_id, prompt_id, how = path_ids[0], path_ids[1], "path"
            elif headers.get("x-session-id"):
                session_id, how = headers["x-session-id"], "header"
                prompt_id = session_id
            else:
                match = self.matcher.find(tenant, messages)
                session_id, how = (match.session_id, "matched") if match else ("s-" + uuid.uuid4().hex[:16], "new")
                prompt_id = session_id
            key = (tenant, session_id)
            index = self._next_turn.get(key, 0)
            self._next_turn[key] = index + 1
        return Turn(tenant, session_id, prompt_id, index, turn_type, done, how)

    def record(self, turn: Turn, messages: list[dict[str, Any]], reply: dict[str, Any]) -> None:
        """After a main turn is served: its next request will start with these messages + reply."""
        if turn.turn_type == "main":
            with self._lock:
                self.matcher.record(turn.tenant, turn.session_id, messages, reply)
