"""The users' style preferences: how each is checked, and how a person says it was broken.

Three are the demo's default set (format: length, bold, lists). Three more are of other kinds
(tone, voice, address) that no default user has: `--preferences` selects any of them, which is how
to check that learning is not tuned to the defaults. The users' preferences must be jointly
satisfiable: one policy serves everyone and never learns who wants what ("Anna, steep coarse
grounds in cold water overnight, then strain." keeps all six).

Base rates on SmolLM2-135M-Instruct (`python -m clawr1.demo.base_rates`: 80 replies to the 8
held-out questions, 10 per question from different users, T=0.7, 64 tokens), the share of replies
whose text keeps the rule: short 0.21, no-bold 0.97, no-steps 0.93, no-exclamation 0.80,
no-first-person 0.36, by-name 0.03. The new three break more often than no-bold and no-steps, so
their users have plenty to correct. Only 3 of the 80 finished within 64 tokens, and a cut-off
reply keeps no preference, so every preference starts near 0 (0.00-0.01 preferred).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

_BOLD = re.compile(r"\*\*|__")
_STEPS = re.compile(r"(?im)^\s*(?:step\s*\d+\b|\d+\s*[.)]\s|[-*\u2022]\s)")
_WORD = re.compile(r"\S+")
_FIRST_PERSON = re.compile(r"(?i)(?<![\w'])(?:i|i'm|i've|i'll|i'd|me|my|mine|myself)(?![\w'])")


def one_short_paragraph(text: str, finished: bool, name: str = "", max_words: int = 50) -> bool:
    """A complete reply in one paragraph (no line breaks) of at most `max_words` words."""
    body = text.strip()
    return finished and bool(body) and "\n" not in body and len(_WORD.findall(body)) <= max_words


def no_bold(text: str, finished: bool, name: str = "") -> bool:
    """No markdown bold (`**x**`, `__x__`)."""
    return finished and not _BOLD.search(text)


def no_steps(text: str, finished: bool, name: str = "") -> bool:
    """No numbered steps, bullet points or 'Step 1:' prefixes."""
    return finished and not _STEPS.search(text)


def no_exclamation(text: str, finished: bool, name: str = "") -> bool:
    """A calm tone: not one exclamation mark."""
    return finished and "!" not in text


def no_first_person(text: str, finished: bool, name: str = "") -> bool:
    """The assistant leaves itself out: no I, me, my, I'm ... (the user wants the answer, not the
    assistant's feelings about it)."""
    return finished and not _FIRST_PERSON.search(text)


def by_name(text: str, finished: bool, name: str = "") -> bool:
    """The reply addresses the user by name (the name is in the system prompt)."""
    return finished and bool(name) and re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text) is not None


@dataclass(frozen=True)
class Preference:
    """A style preference: how to check it, and how a person says it was broken."""

    name: str
    description: str
    check: Callable[..., bool]
    """(reply text, finished?, user's name) -> kept. A reply cut off at the length cap never keeps it."""
    corrections: tuple[str, ...]
    """What a user says when it is broken; `{name}` is the user's name."""


PREFERENCES: dict[str, Preference] = {p.name: p for p in (
    Preference("short", "answers in one short paragraph", one_short_paragraph,
               ("That's way too long. Please answer in one short paragraph.",
                "Too long, sorry. Keep it to one short paragraph next time.",
                "Please make it shorter: one short paragraph is all I need.",
                "Can you keep answers brief? One short paragraph, no more.")),
    Preference("no-bold", "no markdown bold text", no_bold,
               ("Please don't use bold text, I read this in plain text.",
                "No bold formatting please, just plain sentences.",
                "Please stop using ** bold markup in your answers.")),
    Preference("no-steps", "no numbered steps, lists or 'Step 1:' prefixes", no_steps,
               ("Please don't number the steps. Write it as plain sentences instead of a list.",
                "No lists or 'Step 1:' prefixes please, just a normal paragraph.",
                "Please avoid bullet points and numbered steps, plain prose is better.")),
    Preference("no-exclamation", "a calm tone: no exclamation marks", no_exclamation,
               ("Please drop the exclamation marks, a calm tone suits me better.",
                "No exclamation points please. Just say it calmly.",
                "Could you stop with the exclamation marks? It reads like shouting.")),
    Preference("no-first-person", "no talk about the assistant itself (no I, me, my)", no_first_person,
               ("Please don't talk about yourself, just answer the question.",
                "I don't need to hear about you. Just tell me what to do.",
                "Leave yourself out of it please: no 'I' or 'my', only the answer.")),
    Preference("by-name", "addresses the user by name", by_name,
               ("Please call me by my name, {name}.",
                "You can address me as {name}, it feels more personal.",
                "Use my name when you answer, I'm {name}.")),
)}

DEFAULT_PREFERENCES: tuple[str, ...] = ("short", "no-bold", "no-steps")
"""The demo's set; the others are for runs with users whose preferences the defaults lack."""


def parse_preferences(spec: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """`"a,b,c"` (or a list) -> the names, checked; None or empty -> the default set."""
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec or ()) if n.strip()]
    unknown = [n for n in names if n not in PREFERENCES]
    if unknown:
        raise ValueError(f"unknown preference(s) {unknown}; known: {', '.join(PREFERENCES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a preference is named twice in {names}")
    return tuple(names) or DEFAULT_PREFERENCES
