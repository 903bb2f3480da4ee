"""Automatic session matching for stock clients that can set nothing but a base URL.

A request continues session S when its messages start with S's last request messages followed by
S's last assistant reply. Real clients are messy (see shared/OPENCLAW.md), so:
- S's last request message may be absent (OpenClaw appends an internal-context message to every
  request and drops it from the next one);
- tool-call ids are ignored (OpenClaw rewrites them); calls match on name + arguments;
- content compares as text (string or parts), trimmed;
- a long conversation gets compacted: the client replaces the older turns by a summary and keeps
  the system prompt and the recent turns. Such a request no longer starts with S's transcript, but
  its last assistant message is still S's last reply, right after the message S's last request
  ended with (or right after the summary: OpenClaw folds that message into it), and it starts with
  S's system prompt: that continues S too (`Match.compacted`), so S's last turn still gets its next
  state (a reply two sessions share matches neither);
- a compaction may keep no reply at all (`[system, summary, new message]`): nothing of S is left
  in the request but the summary, and the gateway wrote that summary itself when the agent's
  summarising call (a side turn) asked for it. The call's transcript holds S's last reply (and
  its last message), which says which session it summarises; a request whose compaction summary
  contains that summary then continues S (`record_summary`).
- clients edit the replies they resend (`Match.edited`): OpenClaw masks whatever looks like a
  secret in its stored transcript (a run matching one of its key patterns becomes its first six
  characters, `…` and its last four, or `***`: `src/logging/redact.ts`), others trim or collapse
  whitespace, normalise Unicode or drop `<think>` blocks. A request whose messages up to an
  assistant message are exactly S's last request, and whose assistant message is S's last reply
  so edited (`resent_matches`: the same tool calls; its text, once normalised, S's reply with
  pieces masked or its tail cut, keeping at least half of it), continues S; two sessions that
  both fit match neither.
Prefixes are indexed by a rolling hash and last replies by their fingerprint, so a lookup costs
one or two dict probes per message of the request, whatever the number of open sessions. The two
searches by containment (which session a summarising call's transcript holds; which remembered
summary a compaction's summary holds) look at the `SUMMARY_CANDIDATES` sessions of the tenant
with the latest turns only: an agent compacts a session right after one of its turns, and until
2026-12-07 a summariser request was one substring search per open session of every tenant, on
the event loop. Tenants never match across, and every index is keyed by (tenant, session): two
tenants may name a session alike.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from clawr1.core.messages import arguments_object, text_of

# How agents open the message that replaces the turns they compacted away. OpenClaw's (a user
# message; `COMPACTION_SUMMARY_PREFIX` in its harness) also takes in the last user message before
# the reply it keeps, so after it the kept reply follows the summary, not that message.
SUMMARY_OPENINGS = ("The conversation history before this point was compacted into the following summary:",)
# The system prompts of agents' own summarising calls: the history sent as one text to be
# summarised, not a turn of the conversation (recorded as side turns, never trained or matched).
SUMMARISER_PROMPTS = ("You are a context summarization assistant.",)  # OpenClaw's
SUMMARY_CANDIDATES = 64  # a tenant's most recently active sessions a containment search looks at


def is_summary(message: dict[str, Any]) -> bool:
    """A compaction summary in place of older turns."""
    return message.get("role") == "user" and _opens(message, SUMMARY_OPENINGS)


def is_summariser_call(messages: list[dict[str, Any]]) -> bool:
    """An agent asking the model to summarise its own history (compaction), not a user's turn."""
    return bool(messages) and messages[0].get("role") in ("system", "developer") and _opens(messages[0], SUMMARISER_PROMPTS)


def _opens(message: dict[str, Any], openings: tuple[str, ...]) -> bool:
    return text_of(message.get("content"), "content").lstrip().startswith(openings)


def _plain(text: str) -> str:
    """Text compared across an agent's re-rendering: whitespace collapsed."""
    return " ".join(text.split())


# What clients put where they cut something out of a reply they resend: OpenClaw's redaction writes
# `…` (and `***` for a short run); `...` and `[…]` are the usual elisions elsewhere.
_ELISION = re.compile(r"\s*(?:…|\.\.\.|\*\*\*|\[…\]|\[\.\.\.\])\s*")
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
MIN_KEPT = 0.5  # of a reply's text that an edited resend must keep, in order


def _normal(text: str) -> str:
    """A reply's text as clients' edits leave it comparable: reasoning dropped, Unicode in NFKC,
    whitespace collapsed."""
    return _plain(unicodedata.normalize("NFKC", _THINK.sub(" ", text)))


def _calls(message: dict[str, Any]) -> list[tuple[Any, Any]]:
    return [(c.get("function", {}).get("name"), arguments_object(c.get("function", {}).get("arguments")))
            for c in message.get("tool_calls") or []]


def resent_matches(recorded: dict[str, Any], resent: dict[str, Any]) -> bool:
    """Whether `resent` is the reply `recorded` as a client edited it: the same tool calls, and a
    text that (normalised) is the recorded one with pieces cut out where an elision mark stands,
    every kept piece in order, the first at the start and the last at the end unless the resend
    ends with a mark (its tail cut), keeping at least `MIN_KEPT` of it."""
    if resent.get("role") != "assistant" or _calls(recorded) != _calls(resent):
        return False
    was, now = _normal(text_of(recorded.get("content"), "content")), _normal(text_of(resent.get("content"), "content"))
    if was == now:
        return True
    pieces = _ELISION.split(now)
    if len(pieces) == 1:
        return False  # no mark: an edit we cannot tell from another reply
    cursor, last = 0, len(pieces) - 1
    for i, piece in enumerate(pieces):
        if i == 0:
            if not was.startswith(piece):
                return False
            at = 0
        elif i == last and piece:
            at = len(was) - len(piece)
            if at < cursor or not was.endswith(piece):
                return False
        else:
            at = was.find(piece, cursor)
            if at < 0:
                return False
        cursor = at + len(piece)
    return sum(map(len, pieces)) >= MIN_KEPT * len(was)


def _encoder(sort_keys: bool) -> Any:
    """`json.dumps(value, sort_keys=sort_keys)`, its C encoder built once (`json.dumps` builds one
    on every call, as long as encoding a message's fingerprint body takes); no circular-reference
    check (a cycle is a RecursionError, not a ValueError)."""
    if json.encoder.c_make_encoder is None:  # another Python
        return lambda value: json.dumps(value, sort_keys=sort_keys)
    encode = json.encoder.c_make_encoder(None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii,
                                         None, ": ", ", ", sort_keys, False, True)
    return lambda value: "".join(encode(value, 0))


_dumps, _dumps_sorted = _encoder(False), _encoder(True)


def fingerprint(message: dict[str, Any]) -> str:
    """What identifies a message across replays: role, trimmed text, tool calls without ids (their
    arguments as an object: the Anthropic route sends a call whose arguments are none wrapped, and
    its client replays it so)."""
    calls = _calls(message)
    # Only arguments hold mappings to sort; without calls the plain encoder (cached, ~30% faster)
    # writes the same text.
    body = [message.get("role"), text_of(message.get("content"), "content").strip(), calls]
    text = _dumps_sorted(body) if calls else _dumps(body)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _extend(prefix_hash: str, fp: str) -> str:
    """The rolling hash of a prefix (`""`: the empty one) followed by one more message."""
    return hashlib.blake2b((prefix_hash + fp).encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Hashed:
    """A request's messages hashed once, for both the lookup (`find`) and, after the reply, the
    index entry (`record`): each message's fingerprint, and `prefixes[k]`, the rolling hash of
    the first k messages (`prefixes[0]`: none)."""

    fps: list[str]
    prefixes: list[str]


def hashed(messages: list[dict[str, Any]]) -> Hashed:
    fps = [fingerprint(m) for m in messages]
    prefixes = [""]
    for fp in fps:
        prefixes.append(_extend(prefixes[-1], fp))
    return Hashed(fps, prefixes)


@dataclass(frozen=True)
class Match:
    session_id: str
    prefix_len: int  # messages of the request that the session already holds (up to its last reply)
    compacted: bool = False  # matched by its last reply after the client compacted the history
    edited: bool = False  # matched with the last reply as the client edited it (`resent_matches`)


Owner = tuple[str, str]  # (tenant, session id): what every index entry belongs to


class HistoryMatcher:
    """Open sessions' transcripts, indexed by the hash of (request messages + reply)."""

    def __init__(self) -> None:
        self._index: dict[tuple[str, str], tuple[str, int]] = {}  # (tenant, prefix hash) -> (session, len)
        self._keys: dict[Owner, list[tuple[str, str]]] = {}  # its index keys (of `_index` and `_replies`)
        # (tenant, hash of the messages before a session's last reply) -> {session: that reply}, for
        # a resend the client edited (`_edited`).
        self._replies: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
        # (tenant, last reply's fingerprint) -> {session: (its system prompt's fingerprint or None,
        # the fingerprints the message before that reply may have)}; two sessions under one key
        # (the same short reply to the same message) are ambiguous and match neither.
        self._tails: dict[tuple[str, str], dict[str, tuple[str | None, frozenset[str]]]] = {}
        self._tail_keys: dict[Owner, tuple[str, str]] = {}
        # its last reply's text and its last message's text, to find the session a summarising
        # call summarises; and each tenant's sessions, the one with the latest turn last.
        self._last: dict[Owner, tuple[str, str]] = {}
        self._recent: dict[str, dict[str, None]] = {}
        # tenant -> {a summary the model wrote for an agent's compaction: the session it summarises},
        # the latest written last
        self._summaries: dict[str, dict[str, str]] = {}
        self._summary_keys: dict[Owner, str] = {}

    def find(self, tenant: str, messages: list[dict[str, Any]], hashes: Hashed | None = None) -> Match | None:
        """The session whose transcript is the longest prefix of `messages`, if any (its last reply
        as sent, or as the client edited it). `hashes`: the messages' `hashed`, when the caller has
        it (a request's messages are hashed once)."""
        hashes = hashes if hashes is not None else hashed(messages)
        exact = next((Match(hit[0], k) for k in range(len(messages), 0, -1)
                      if (hit := self._index.get((tenant, hashes.prefixes[k]))) is not None), None)
        edited = self._edited(tenant, messages, hashes, exact.prefix_len if exact else 0)
        return edited or exact or self._compacted(tenant, messages, hashes.fps)

    def _edited(self, tenant: str, messages: list[dict[str, Any]], hashes: Hashed, beyond: int) -> Match | None:
        """The one session whose last request is exactly the messages before an assistant message
        of this request (past its first `beyond`), and whose last reply that message is, as edited."""
        for j in range(len(messages) - 1, max(beyond, 1) - 1, -1):
            if messages[j].get("role") != "assistant":
                continue
            owners = self._replies.get((tenant, hashes.prefixes[j]))
            if owners:
                fits = [session for session, reply in owners.items() if resent_matches(reply, messages[j])]
                if len(fits) == 1:
                    return Match(fits[0], j + 1, edited=True)
        return None

    def _compacted(self, tenant: str, messages: list[dict[str, Any]], fps: list[str]) -> Match | None:
        """The session a compacted request continues: the request's last assistant message is the
        session's last reply (what the user's new message answers), right after the message the
        session's last request ended with (or after a compaction summary), and the request starts
        with the same system prompt."""
        j = next((i for i in range(len(messages) - 1, 0, -1) if messages[i].get("role") == "assistant"), None)
        owners = self._tails.get((tenant, fps[j])) if j is not None else None
        if owners and len(owners) == 1:
            [(session_id, (system, before))] = owners.items()
            if (fps[j - 1] in before or is_summary(messages[j - 1])) and (system is None or fps[0] == system):
                return Match(session_id, j + 1, compacted=True)
        return self._summarised(tenant, messages, fps) if tenant in self._summaries else None

    def _summarised(self, tenant: str, messages: list[dict[str, Any]], fps: list[str]) -> Match | None:
        """The session a compaction that kept no reply continues: its summary message holds a
        summary this gateway wrote for that session's summarising call, under the same system prompt."""
        k = next((i for i, m in enumerate(messages) if is_summary(m)), None)
        if k is None:
            return None
        text = _plain(text_of(messages[k].get("content"), "content"))
        latest = itertools.islice(reversed(self._summaries[tenant].items()), SUMMARY_CANDIDATES)
        found = {session for summary, session in latest if summary in text}
        if len(found) != 1:
            return None
        [session_id] = found
        system = self._tails[self._tail_keys[(tenant, session_id)]][session_id][0]  # a summarised session is open
        if system is not None and fps[0] != system:
            return None
        return Match(session_id, k + 1, compacted=True)

    def record_summary(self, tenant: str, messages: list[dict[str, Any]], summary: dict[str, Any]) -> str | None:
        """After an agent's summarising call: remember the summary the model wrote, for the one open
        session whose last reply (and, to break a tie, last message) its transcript holds. Returns
        that session, or None when no one session is summarised (nothing is remembered)."""
        written = _plain(text_of(summary.get("content"), "content"))
        if len(written) < 16:  # too short to identify a session by containment
            return None
        session_id = self.summarised(tenant, messages)
        if session_id is None:
            return None
        self._forget_summary(tenant, session_id)
        mine = self._summaries.setdefault(tenant, {})
        mine.pop(written, None)  # written again: the latest
        mine[written] = session_id
        self._summary_keys[(tenant, session_id)] = written
        return session_id

    def summarised(self, tenant: str, messages: list[dict[str, Any]]) -> str | None:
        """The one open session a summarising call's transcript holds the last reply (and, to break
        a tie, the last message) of; None when there is not exactly one."""
        transcript = _plain(" ".join(text_of(m.get("content"), "content") for m in messages))
        latest = itertools.islice(reversed(self._recent.get(tenant, {})), SUMMARY_CANDIDATES)
        held = [s for s in latest if (reply := self._last[(tenant, s)][0]) and reply in transcript]
        if len(held) > 1:
            held = [s for s in held if self._last[(tenant, s)][1] and self._last[(tenant, s)][1] in transcript]
        return held[0] if len(held) == 1 else None

    def record(self, tenant: str, session_id: str, messages: list[dict[str, Any]], reply: dict[str, Any],
               hashes: Hashed | None = None) -> None:
        """After a turn: the next request of this session starts with these messages + reply
        (`hashes`: theirs, when `find` already had them)."""
        owner = (tenant, session_id)
        self.forget(tenant, session_id)
        hashes = hashes if hashes is not None else hashed(messages)
        fps, reply_fp = hashes.fps, fingerprint(reply)
        keys = []
        lengths = [len(fps)] + ([len(fps) - 1] if len(fps) > 1 else [])  # the last message may be dropped
        for length in lengths:
            key = (tenant, _extend(hashes.prefixes[length], reply_fp))
            keys.append(key)
            self._index[key] = (session_id, length + 1)
            before = (tenant, hashes.prefixes[length])
            keys.append(before)
            self._replies.setdefault(before, {})[session_id] = reply
        self._keys[owner] = keys
        system = fps[0] if messages and messages[0].get("role") in ("system", "developer") else None
        self._tails.setdefault((tenant, reply_fp), {})[session_id] = (system, frozenset(fps[-2:]))
        self._tail_keys[owner] = (tenant, reply_fp)
        last = _plain(text_of(messages[-1].get("content"), "content")) if messages else ""
        self._last[owner] = (_plain(text_of(reply.get("content"), "content")), last)
        self._recent.setdefault(tenant, {})[session_id] = None  # `forget` took it out: now the latest

    def forget(self, tenant: str, session_id: str) -> None:
        owner = (tenant, session_id)
        for key in self._keys.pop(owner, []):
            if self._index.get(key, (None,))[0] == session_id:
                del self._index[key]
            replies = self._replies.get(key)
            if replies is not None:
                replies.pop(session_id, None)
                if not replies:
                    del self._replies[key]
        tail = self._tail_keys.pop(owner, None)
        owners = self._tails.get(tail) if tail is not None else None
        if owners is not None:
            owners.pop(session_id, None)
            if not owners:
                del self._tails[tail]
        if self._last.pop(owner, None) is not None:
            recent = self._recent[tenant]
            del recent[session_id]
            if not recent:
                del self._recent[tenant]
        self._forget_summary(tenant, session_id)

    def _forget_summary(self, tenant: str, session_id: str) -> None:
        summary = self._summary_keys.pop((tenant, session_id), None)
        mine = self._summaries.get(tenant)
        if summary is not None and mine is not None and mine.get(summary) == session_id:
            del mine[summary]
            if not mine:
                del self._summaries[tenant]

    def __len__(self) -> int:
        return len(self._keys)
