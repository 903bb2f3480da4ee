"""Simulated users for the personal-agent track: rule-based, seeded, and honest.

Each user has one stated style preference and a hidden checker for it. The user never tells the
system its preference directly: it asks everyday questions, replies with a natural correction when
a reply breaks the preference ("please don't use bold text") or was cut off at the client's length
cap (every user minds an unfinished answer), and with thanks plus a new question when the reply
is complete and keeps the preference: exactly the next states a real user produces. The checker only *measures*
(the preference score); learning goes through the production judge and hint path.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

_BOLD = re.compile(r"\*\*|__")
_STEPS = re.compile(r"(?im)^\s*(?:step\s*\d+\b|\d+\s*[.)]\s|[-*\u2022]\s)")
_WORD = re.compile(r"\S+")


def one_short_paragraph(text: str, finished: bool, max_words: int = 50) -> bool:
    """A complete reply in one paragraph (no line breaks) of at most `max_words` words."""
    body = text.strip()
    return finished and bool(body) and "\n" not in body and len(_WORD.findall(body)) <= max_words


@dataclass(frozen=True)
class Preference:
    """A style preference: how to check it, and how a person says it was broken."""

    name: str
    description: str
    check: Callable[[str, bool], bool]
    """(reply text, finished?) -> kept. A reply cut off at the length cap never keeps it."""
    corrections: tuple[str, ...]


PREFERENCES: dict[str, Preference] = {p.name: p for p in (
    Preference("short", "answers in one short paragraph",
               one_short_paragraph,
               ("That's way too long. Please answer in one short paragraph.",
                "Too long, sorry. Keep it to one short paragraph next time.",
                "Please make it shorter: one short paragraph is all I need.",
                "Can you keep answers brief? One short paragraph, no more.")),
    Preference("no-bold", "no markdown bold text",
               lambda text, finished: finished and not _BOLD.search(text),
               ("Please don't use bold text, I read this in plain text.",
                "No bold formatting please, just plain sentences.",
                "Please stop using ** bold markup in your answers.")),
    Preference("no-steps", "no numbered steps, lists or 'Step 1:' prefixes",
               lambda text, finished: finished and not _STEPS.search(text),
               ("Please don't number the steps. Write it as plain sentences instead of a list.",
                "No lists or 'Step 1:' prefixes please, just a normal paragraph.",
                "Please avoid bullet points and numbered steps, plain prose is better.")),
)}

CUT_OFF = ("Your answer got cut off mid-sentence. Please keep it shorter so it fits.",
           "That was cut off before the end. A shorter answer would be better.",
           "You stopped mid-sentence. Please give a complete but brief answer.")
THANKS = ("Thanks, that's helpful!", "Great, thank you.", "Perfect, thanks.", "Nice, that works for me.",
          "Thanks! That's exactly what I needed.")
NEXT = ("Another question:", "Next one:", "Also,", "One more thing:")

# Everyday questions a personal assistant gets. The held-out set is never asked during training.
QUESTIONS = (
    "How do I make a good cup of tea?", "What should I pack for a weekend hiking trip?",
    "How can I sleep better?", "Any tips for saving money on groceries?", "How do I keep my houseplants alive?",
    "What's a quick healthy breakfast?", "How do I clean a cast iron pan?",
    "How can I be more productive when working from home?", "What is a good way to learn a new language?",
    "How do I prepare for a job interview?", "How often should I water a cactus?",
    "What's the best way to remove a coffee stain?", "How do I start running as a beginner?",
    "How can I reduce stress after work?", "How do I boil an egg?", "What should I cook for a dinner party of six?",
    "How do I write a polite email to decline an invitation?", "What are some good stretches for a stiff back?",
    "How can I make my phone battery last longer?", "What should I do if my bike chain keeps slipping?",
    "How do I organise a small closet?", "What's a good gift for a friend who likes cooking?",
    "How do I get rid of fruit flies in the kitchen?", "How can I drink more water during the day?",
    "How do I plan a budget for a holiday?", "What's an easy way to start meditating?",
    "How do I keep bread fresh for longer?", "How should I prepare for a long flight?",
    "How do I remember people's names better?", "What's a simple pasta recipe for tonight?",
    "How can I keep my kids busy on a rainy day?", "How do I choose a good watermelon?",
    "How do I fix a squeaky door?", "What's the best way to store fresh herbs?",
    "How can I make my mornings less rushed?", "How do I politely ask a neighbour to be quieter?",
)
HELD_OUT = (
    "How do I make cold brew coffee at home?", "What can I do to focus better while studying?",
    "How do I pick a good avocado?", "How should I care for a new leather jacket?",
    "What's a nice way to spend a Sunday afternoon?", "How do I get better at public speaking?",
    "How can I keep my car clean inside?", "What should I eat before a morning workout?",
)
NAMES = ("Anna", "Ben", "Chloe", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Liam")


@dataclass
class SimulatedUser:
    """One user: a name, a preference and a seeded stream of questions and reactions."""

    name: str
    preference: Preference
    rng: random.Random
    turns_per_conversation: int = 3
    questions: tuple[str, ...] = QUESTIONS
    asked: int = field(default=0)

    @property
    def system(self) -> str:
        return f"You are {self.name}'s personal assistant. Be helpful and friendly."

    def first_message(self) -> str:
        return self.next_question()

    def next_question(self) -> str:
        self.asked += 1
        return self.rng.choice(self.questions)

    def react(self, reply: str, finished: bool) -> tuple[bool, str]:
        """(kept the preference?, the user's next message)."""
        if self.preference.check(reply, True):  # the preference itself holds (as far as it goes)
            if finished:
                return True, f"{self.rng.choice(THANKS)} {self.rng.choice(NEXT)} {self.next_question()}"
            return False, self.rng.choice(CUT_OFF)
        return False, self.rng.choice(self.preference.corrections)


def make_users(n: int, seed: int, preferences: list[str] | None = None, turns: int = 3) -> list[SimulatedUser]:
    """`n` users, preferences assigned round-robin so each is equally represented."""
    names = preferences or list(PREFERENCES)
    return [SimulatedUser(NAMES[i % len(NAMES)] + ("" if i < len(NAMES) else str(i)), PREFERENCES[names[i % len(names)]],
                          random.Random(seed * 1000 + i), turns) for i in range(n)]
