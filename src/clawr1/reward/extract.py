"""Hints without a model: the correction sentences of the user's message, or the error lines of a
failed tool call. Used by the classifier judge, which cannot write text of its own.

A sentence counts when it says something concrete. Generic complaints ("That's wrong. Try again.")
and pleasantries are dropped, and so are plain questions, which re-ask rather than correct.
"""

from __future__ import annotations

import re

from clawr1.reward.rules import tool_failures
from clawr1.reward.turn import message_text
from clawr1.reward.types import HintResult, Message

_SPLIT = re.compile(r"(?<=[.!?])\s+|\n+")
# Phrases that carry no correction on their own: removing them must leave real words behind.
_GENERIC = re.compile(
    r"\b(?:no+|nope|hmm+|meh|ok(?:ay)?|well|please|pls|thanks?|thank you|sorry|again|redo(?: it)?|regenerate|"
    r"try again|give it another go|another one|something else|are you sure|check again|that'?s|that is|"
    r"this is|it'?s|it is|not|right|wrong|correct|incorrect|helpful|what i (?:asked|wanted)|it|that|this|"
    r"you didn'?t answer(?: the| my)? question|doesn'?t answer(?: it| my question)?|explains nothing|"
    r"the|a|an|i|me|my|do|does|did|just|quite|really|at all|let me|ask|more|clearly|rephrase|"
    r"can you|could you|would you|will you|try|is|was|be|so|yet|still|nothing)\b",
    re.IGNORECASE,
)
_CUE = re.compile(r"\b(?:don'?t|do not|never|not|no|stop|avoid|instead|rather|wrong|should|must|need|only|"
                  r"i said|i meant|i asked|forgot|missing|too|use|make|keep|add|remove)\b", re.IGNORECASE)
_MIN_WORDS = 2
TOOL_PREFIX = "The previous tool call failed: "


def _content_words(sentence: str) -> int:
    return len(re.findall(r"[A-Za-z0-9_'#./-]{2,}", _GENERIC.sub(" ", sentence)))


def correction_sentences(text: str) -> list[str]:
    """The sentences of a user message that say concretely what to change."""
    kept = []
    for sentence in (s.strip() for s in _SPLIT.split(text)):
        if not sentence or _content_words(sentence) < _MIN_WORDS:
            continue
        if sentence.endswith("?") and not _CUE.search(sentence):
            continue
        kept.append(sentence)
    return kept


def tool_error_lines(next_state: list[Message]) -> list[str]:
    """Informative failure lines of the tool messages (not bare exit codes), in order, deduplicated."""
    lines: list[str] = []
    for i, message in enumerate(next_state):
        if message.get("role") == "tool":
            text = message_text(message, f"next_state[{i}].content")
            for _, line, info in tool_failures(text):
                if info and line not in lines:
                    lines.append(line)
    return lines


def extract_hint(next_state: list[Message], min_chars: int) -> HintResult:
    """A hint from the user's correction sentences, else from the tool's error lines (the last two:
    in a traceback and in a test summary the cause comes last)."""
    parts: list[str] = []
    for i, message in enumerate(next_state):
        if message.get("role") == "user":
            parts += correction_sentences(message_text(message, f"next_state[{i}].content"))
    if parts:
        hint = " ".join(parts)
    else:
        errors = tool_error_lines(next_state)[-2:]
        if not errors:
            return HintResult(None, "no_correction")
        hint = TOOL_PREFIX + " | ".join(line[:300] for line in errors)
    if len(hint) < min_chars:
        return HintResult(None, "too_short", [hint])
    return HintResult(hint, None, [hint])
