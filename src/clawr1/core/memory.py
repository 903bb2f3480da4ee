"""Per-user memory, the fast speed of learning: what an entry is, which entries conflict, and how
the gateway adds a user's entries to a system prompt (and how that is taken out again).

An entry is the text of a hint from a correction (the judge's, or explicit feedback), kept for the
user whose turn was corrected, in that turn's tenant. The pool stores entries (`datapool/ops.py`,
in the transaction that stores the hint), the gateway adds a user's active entries to the system
prompt of that user's later requests (`gateway/memory.py`), before the chat template renders, so
the served prompt, memory included, is the one the step records token for token. Each step records
which entries it carried and the exact text they added (`record`), so a trainer can rebuild the
prompt without them (`without`): student without the memory, teacher with it.

Rules written down here, one place each:
- an entry is one line of at most `MAX_ENTRY_CHARS` characters (whitespace folded), refused when it
  points back at the one reply it corrects (`ONE_OFF`: "I asked about ...", "that doesn't answer
  my question": a failure its reward carries, no lasting preference) or holds a chat-template
  control sequence (`CONTROL`: `<|im_start|>`, `<|im_end|>`, `<|endoftext|>`,
  `[INST]`, `<s>`, control characters ...). The gateway also refuses, when it loads entries, any
  entry holding the text of one of its tokenizer's added or special tokens;
- a conflict: two entries of one user on the same `topic` (a small keyword rule, first match in a
  fixed order; an entry that names none of the topics is its own topic, its normalised text, so
  only a repeat of it conflicts). The newer entry wins: the older is `replaced`. A repeat of an
  active entry is not stored again;
- a user keeps at most `MAX_ACTIVE` active entries (the oldest beyond it are `evicted`); a prompt
  gets the newest that fit `memory.max_entries` and `memory.max_prompt_chars`, oldest first.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

MAX_ENTRY_CHARS = 400
"""Longest entry kept (after whitespace is folded); a longer hint is refused as an entry (it still
trains as a hint). A judge's hint is a sentence or two."""

MAX_ACTIVE = 32
"""Active entries one user keeps; a newer one beyond it evicts the oldest."""

MAX_CORRECTION_CHARS = 2000
"""Of the correction an entry came from (the next state's user text, or the feedback), kept with it
for provenance."""

STATUSES = ("active", "replaced", "forgotten", "refused", "evicted", "retired")

MAX_CHECKS = 32
"""Per entry, the newest versions' consolidation measures kept (`checks`)."""

RECHECK_STEPS = 4
"""Steps a retired entry is measured again on (the newest of those that retired it)."""

TOOL_HINT_PREFIX = "The previous tool call failed: "
"""How the judge's hints from a failed tool call begin (`reward/extract.py` TOOL_PREFIX): about one
call's error, not about the user, so they make no entry."""

HEADER = "Remember what this user asked for in earlier conversations:"

# Chat-template control sequences of the common template families, whatever the served model: an
# entry must never be able to close the system turn and open another. The served tokenizer's own
# added tokens are checked on top (`unsafe`).
CONTROL = re.compile(
    r"<\|[^<>\n]{0,64}\|>"  # ChatML, Qwen, Llama 3, Phi: <|im_start|>, <|im_end|>, <|endoftext|>, <|eot_id|>
    r"|<\uff5c[^<>\n]{0,64}\uff5c>"  # DeepSeek's full-width bars
    r"|</?(?:s|unk|pad|bos|eos|start_of_turn|end_of_turn|tool_call|tool_response)>"
    r"|\[/?INST\]|<</?SYS>>"
    r"|[\x00-\x1f\x7f-\x9f\u2028\u2029]",  # control characters (after whitespace is folded)
    re.IGNORECASE)

# The conflict rule's topics, in order: the first whose words an entry names is its topic. Formats
# come before length, whose words ("paragraph", "sentences") also turn up in other corrections.
TOPICS: tuple[tuple[str, re.Pattern[str]], ...] = tuple((name, re.compile(pattern)) for name, pattern in (
    ("lists", r"\b(?:lists?|listing|bullets?|bullet points?|numbered|numbering|number the|steps?|enumerat\w*)\b"),
    ("bold", r"\b(?:bold|markdown|markup|italics?|headings?|headers?|formatting)\b|\*\*"),
    ("exclamation", r"\bexclamation\w*|\bshouting\b|\bcalm(?:ly)?\b"),
    ("self", r"\b(?:yourself|about you|first person|first-person)\b|'i'"),
    ("name", r"\b(?:my name|their name|user's name|call me|address me|by name)\b"),
    ("language", (r"\b(?:english|french|german|spanish|italian|portuguese|chinese|japanese|korean|russian|"
                 r"arabic|dutch|language)\b")),
    ("emoji", r"\b(?:emojis?|emoticons?|smileys?)\b"),
    ("tone", r"\b(?:tone|formal\w*|casual\w*|polite\w*|friendly|rude)\b"),
    ("length", (r"\b(?:short\w*|brief\w*|concise\w*|long\w*|length|paragraphs?|sentences?|words?|verbose|wordy|"
               r"detailed|details?|elaborate)\b")),
))
# A correction about this one reply ("That has nothing to do with my question. I asked about eggs.",
# "What do you mean?") says the reply failed, which its reward already says; as a standing line in
# every later system prompt it would point at a question the user is no longer asking.
ONE_OFF = re.compile(
    r"\b(?:i asked about|i asked:|i was asking about|not what i (?:asked|meant)|(?:has|had|is) nothing to do with|"
    r"(?:didn't|doesn't|did not|does not|haven't|have not|hasn't) (?:actually |really |even )?"
    r"(?:answer(?:ed)? (?:my|the|that|it|this)|(?:tell|told) me anything)|not an answer|answer (?:it|that)[.?!]|"
    r"what do you mean|makes? no sense|(?:just|you) repeated (?:my|that|the)|why are you repeating|"
    r"(?:just|only) my own words|(?:that's|that is|this is) off[- ]topic)", re.IGNORECASE)
_SPACE = re.compile(r"\s+")
_EDGES = re.compile(r"^[\W_]+|[\W_]+$")


def fold(text: str) -> str:
    """An entry's text as it is kept: NFKC, whitespace (newlines included) folded to single spaces."""
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text)).strip()


def refusal(text: str) -> str | None:
    """Why `text` (folded) cannot be an entry, or None."""
    if not text:
        return "empty"
    if len(text) > MAX_ENTRY_CHARS:
        return f"longer than {MAX_ENTRY_CHARS} characters ({len(text)})"
    found = CONTROL.search(text)
    if found:
        return f"holds a chat-template control sequence {found.group(0)!r}"
    found = ONE_OFF.search(text)
    if found:
        return f"about that one reply ({found.group(0)!r}), not how to answer: its reward says it"
    return None


def normal(text: str) -> str:
    """The form repeats are recognised by: folded, lower case, no punctuation at either end."""
    return _EDGES.sub("", fold(text).lower())


def topic(text: str) -> str:
    """The conflict rule: the first of `TOPICS` whose words `text` names, else `text:` and its
    normalised text (only a repeat conflicts with it)."""
    lowered = normal(text)
    for name, pattern in TOPICS:
        if pattern.search(lowered):
            return name
    return "text:" + lowered


def unsafe(text: str, specials: frozenset[str] | set[str]) -> str | None:
    """The first of a tokenizer's added or special tokens (`specials`: their texts) that `text`
    holds, or None. Such text would be tokenized as that token, whatever the entry meant."""
    return next((s for s in specials if s in text), None)


def block(texts: list[str]) -> str:
    """The memory as the system prompt carries it."""
    return HEADER + "".join(f"\n- {t}" for t in texts)


def add_to(messages: list[dict[str, Any]], text: str) -> tuple[list[dict[str, Any]], str, str]:
    """`messages` with the memory `text` in the system prompt: appended to a leading system (or
    developer) message, else a new system message first. Returns (messages, the exact text added,
    where: `system` (appended to its string content), `null` (the content of a system message
    that had none, JSON's null), `part` (a text part appended to its parts), `new` (a message of
    its own)). The caller's list and dicts are not changed."""
    first = messages[0] if messages else None
    if first is not None and first.get("role") in ("system", "developer"):
        content = first.get("content")
        if content is None:  # kept apart from "": `without` must give back the null the client sent
            return [{**first, "content": text}, *messages[1:]], text, "null"
        if isinstance(content, str):
            added = ("\n\n" if content else "") + text
            return [{**first, "content": content + added}, *messages[1:]], added, "system"
        if isinstance(content, list):
            added = "\n\n" + text
            return [{**first, "content": [*content, {"type": "text", "text": added}]}, *messages[1:]], added, "part"
    return [{"role": "system", "content": text}, *messages], text, "new"


def without(messages: list[dict[str, Any]], record: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The inverse of `add_to`: a step's recorded messages as the client sent them, from its memory
    `record` (`Step.memory`). Messages that carry no memory come back as they are."""
    if not record or not record.get("entries") or not messages:
        return messages
    added, at, first = record["added"], record["at"], messages[0]
    if at == "new":
        return messages[1:]
    content = first.get("content")
    if at == "null" and content == added:
        return [{**first, "content": None}, *messages[1:]]
    if at == "system" and isinstance(content, str) and content.endswith(added):
        return [{**first, "content": content[: len(content) - len(added)]}, *messages[1:]]
    if at == "part" and isinstance(content, list) and content and content[-1].get("text") == added:
        return [{**first, "content": content[:-1]}, *messages[1:]]
    raise ValueError(f"the messages do not carry the memory their record says ({at!r})")


def record(user: str, entries: list[tuple[int, str]], added: str, at: str | None) -> dict[str, Any]:
    """What a step keeps of its memory (`Step.memory`): whose it is, which entries its prompt
    carried (id and text), the exact text they added and where (`add_to`). With no entries: only
    the user, so a correction of this turn makes an entry of theirs."""
    if not entries:
        return {"user": user}
    return {"user": user, "entries": [{"id": i, "text": t} for i, t in entries], "added": added, "at": at}


def learned(checks: list[dict[str, Any]], last: int = 6) -> str:
    """An entry's consolidation measure per version (`checks`), the newest `last`: how much the
    reminder changes what the version says, in nats a token, on the replies it trained on
    (`trainer/consolidate.py`) or, marked "probes", on its held-out probes (`guard/memory.py`);
    near 0, the weights have learned the entry."""
    return ", ".join(f"v{c['version']} {c['gap']:+.2f}" + (" probes" if c.get("source") == "probes" else "")
                     for c in checks[-last:])
