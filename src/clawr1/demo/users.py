"""Simulated users for the personal-agent track: rule-based, seeded, and honest.

Each user has one style preference and a hidden checker for it. The user never tells the system
its preference directly: it asks everyday questions and reacts as a person would, in this order:
- a reply that does not answer the question (off topic, a few words, the system prompt or the
  question echoed back, a loop: `questions.non_answer`) gets a complaint ("That doesn't answer
  my question.", "What? That makes no sense.") and never counts as keeping the preference, so
  short nonsense cannot score;
- with `wants_substance` (the demo's `--users-want-substance`), an answer that says nothing the
  question did not (`questions.substantive`) gets "That doesn't really tell me anything. I asked about ...";
- a reply that breaks the preference gets a natural correction ("please don't use bold text");
- a reply cut off at the client's length cap gets "that was cut off" (every user minds it);
- anything else gets thanks plus a new question.
These are exactly the next states a real user produces. The checker only *measures* (the
preference score); learning goes through the production judge and hint path.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from clawr1.demo.preferences import DEFAULT_PREFERENCES, PREFERENCES, Preference, one_short_paragraph
from clawr1.demo.questions import HELD_OUT, QUESTIONS, asked, non_answer, substantive

__all__ = ["CUT_OFF", "HELD_OUT", "NON_ANSWER", "PREFERENCES", "QUESTIONS", "SAYS_NOTHING", "THANKS", "Assessment",
           "SimulatedUser", "make_users", "one_short_paragraph"]

CUT_OFF = ("Your answer got cut off mid-sentence. Please keep it shorter so it fits.",
           "That was cut off before the end. A shorter answer would be better.",
           "You stopped mid-sentence. Please give a complete but brief answer.")
THANKS = ("Thanks, that's helpful!", "Great, thank you.", "Perfect, thanks.", "Nice, that works for me.",
          "Thanks! That's exactly what I needed.")
NEXT = ("Another question:", "Next one:", "Also,", "One more thing:")
SAYS_NOTHING = "says nothing new"
"""`Assessment.non_answer` of an answer that says nothing the question did not (`wants_substance`)."""
# What a person says to a reply that is not an answer, by why it is not; `{asked}` points back at
# the question ("I asked about cold brew coffee.").
_NONSENSE = ("What? That makes no sense.", "Sorry, what do you mean? {asked}", "Huh? That's not an answer. {asked}")
NON_ANSWER: dict[str, tuple[str, ...]] = {
    "off topic": ("That doesn't answer my question.", "Sorry, what do you mean? {asked}",
                  "That has nothing to do with my question. {asked}"),
    "repeats the question": ("You just repeated my question back to me. Can you answer it?",
                             "Why are you repeating that? {asked}",
                             "That's just my own words again. Please answer it."),
    "too short": _NONSENSE, "loops": _NONSENSE, "empty": _NONSENSE,
    # Judged -1 by the classifier after 43, 44 and 44 of the 44 questions' `asked` lines.
    SAYS_NOTHING: ("That doesn't really tell me anything. {asked}", "You didn't actually answer that. {asked}",
                   "You haven't told me anything. {asked}"),
}
NAMES = ("Anna", "Ben", "Chloe", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Liam")


@dataclass(frozen=True)
class Assessment:
    """What a user makes of one reply. `preferred`: it answers, keeps the preference and finished."""

    answers: bool
    non_answer: str | None
    """Why it is not an answer (`questions.non_answer`), None when it is one."""
    keeps_rule: bool
    """The preference's own rule holds (as far as the reply goes, cut-off aside)."""
    finished: bool

    @property
    def preferred(self) -> bool:
        return self.answers and self.keeps_rule and self.finished


@dataclass
class SimulatedUser:
    """One user: a name, a preference and a seeded stream of questions and reactions."""

    name: str
    preference: Preference
    rng: random.Random
    turns_per_conversation: int = 3
    questions: tuple[str, ...] = QUESTIONS
    asked: int = field(default=0)
    question: str = ""
    """The question the user is waiting to have answered."""
    wants_substance: bool = False
    """Also complain about an answer that says nothing the question did not (`SAYS_NOTHING`)."""

    @property
    def system(self) -> str:
        return f"You are {self.name}'s personal assistant. Be helpful and friendly."

    def first_message(self) -> str:
        return self.next_question()

    def next_question(self) -> str:
        self.asked += 1
        self.question = self.rng.choice(self.questions)
        return self.question

    def assess(self, question: str, reply: str, finished: bool) -> Assessment:
        """The user's verdict on `reply` to `question` (pure: no randomness, no state)."""
        why = non_answer(question, reply, self.system)
        if why is None and self.wants_substance and not substantive(question, reply):
            why = SAYS_NOTHING
        return Assessment(answers=why is None, non_answer=why,
                          keeps_rule=self.preference.check(reply, True, self.name), finished=finished)

    def react(self, reply: str, finished: bool) -> tuple[bool, str]:
        """(preferred?, the user's next message) for a reply to the current question."""
        verdict = self.assess(self.question, reply, finished)
        if verdict.non_answer is not None:
            return False, self.rng.choice(NON_ANSWER[verdict.non_answer]).format(asked=asked(self.question))
        if not verdict.keeps_rule:
            return False, self.rng.choice(self.preference.corrections).format(name=self.name)
        if not finished:
            return False, self.rng.choice(CUT_OFF)
        return True, f"{self.rng.choice(THANKS)} {self.rng.choice(NEXT)} {self.next_question()}"


def make_users(n: int, seed: int, preferences: list[str] | tuple[str, ...] | None = None,
               turns: int = 3, wants_substance: bool = False) -> list[SimulatedUser]:
    """`n` users, preferences (default: the demo's three) assigned round-robin so each is equally
    represented."""
    names = tuple(preferences or DEFAULT_PREFERENCES)
    return [SimulatedUser(NAMES[i % len(NAMES)] + ("" if i < len(NAMES) else str(i)),
                          PREFERENCES[names[i % len(names)]], random.Random(seed * 1000 + i), turns,
                          wants_substance=wants_substance) for i in range(n)]
