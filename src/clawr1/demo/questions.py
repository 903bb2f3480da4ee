"""The simulated users' questions, and what a person checks before anything else: did the reply
answer the question at all?

Every question carries what it is about (for "I asked about cold brew coffee") and a few topic
words. A person reading a reply to "How do I fix a squeaky door?" expects to see a door, a hinge
or some oil in it; "Your sister talking to you." mentions none of them and is not an answer,
however politely it is phrased. The rules are plain word checks, deliberately independent of the
quality measures (`clawr1.quality`): the users must not share a blind spot with the meter.

A topic word matches any reply word it starts ("hinge" matches "hinges", "lubric" matches
"lubricant"), so a handful per question covers an on-topic answer's usual words; a word of three
letters or fewer matches only itself with a plural or -ing/-ed ending ("car" is not "care",
"tea" is not "team"). On SmolLM2-135M's own replies (T=0.7, 64 tokens), 0.91 of 80 to the held-out
questions and 34 of 36 to the training ones pass; every one flagged was read, and none answered.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
MIN_WORDS = 5
"""A reply of fewer words answers nothing ("You're right.")."""
ECHO_SHARE = 0.6
MIN_NEW_WORDS = 5
"""A reply with this share of the system prompt's (or the question's) words and fewer new words
than `MIN_NEW_WORDS` repeats it instead of answering."""
MIN_DISTINCT = 0.35
"""A reply of 12+ words whose distinct words are a smaller share than this is a loop."""


@dataclass(frozen=True)
class Topic:
    """What a question is about, in the user's words, and the word stems an answer mentions."""

    about: str
    words: tuple[str, ...]


TOPICS: dict[str, Topic] = {
    # Asked while the users talk (trained on).
    "How do I make a good cup of tea?":
        Topic("making tea", ("tea", "kettle", "boil", "steep", "brew", "leaves", "cup")),
    "What should I pack for a weekend hiking trip?":
        Topic("packing for a hike", ("pack", "hik", "trail", "boot", "water", "snack", "jacket", "map", "layer", "gear",
                                     "cloth")),
    "How can I sleep better?":
        Topic("sleeping better", ("sleep", "bed", "rest", "night", "nap", "tired", "insomnia", "pillow", "caffeine",
                                  "routine")),
    "Any tips for saving money on groceries?":
        Topic("saving on groceries", ("grocer", "money", "sav", "budget", "shop", "store", "coupon", "list", "price",
                                      "cheap", "food", "buy")),
    "How do I keep my houseplants alive?":
        Topic("houseplants", ("plant", "water", "soil", "light", "sun", "pot", "leaves", "leaf", "fertili", "sunl")),
    "What's a quick healthy breakfast?":
        Topic("a healthy breakfast", ("breakfast", "oat", "oatm", "egg", "fruit", "yog", "toast", "smoothie", "granola",
                                      "cereal", "banana", "berr", "protein", "healthy")),
    "How do I clean a cast iron pan?":
        Topic("cleaning a cast iron pan", ("pan", "iron", "skillet", "clean", "scrub", "oil", "season", "rust", "wash",
                                           "soap")),
    "How can I be more productive when working from home?":
        Topic("working from home", ("work", "productiv", "home", "office", "desk", "schedule", "task", "focus", "break",
                                    "routine", "distract")),
    "What is a good way to learn a new language?":
        Topic("learning a language", ("language", "learn", "vocabular", "grammar", "practi", "speak", "word", "fluen",
                                      "native", "lesson")),
    "How do I prepare for a job interview?":
        Topic("job interviews", ("interview", "job", "employer", "compan", "question", "resume", "prepar", "research",
                                 "role", "position")),
    "How often should I water a cactus?":
        Topic("watering a cactus", ("cact", "water", "soil", "succulent", "dry", "week", "month", "drain")),
    "What's the best way to remove a coffee stain?":
        Topic("coffee stains", ("stain", "coffee", "vinegar", "baking", "soda", "detergent", "wash", "blot", "soap",
                                "fabric", "clean")),
    "How do I start running as a beginner?":
        Topic("running", ("run", "runn", "jog", "pace", "shoe", "mile", "walk", "beginner", "distance", "minute")),
    "How can I reduce stress after work?":
        Topic("stress after work", ("stress", "relax", "work", "breath", "meditat", "exercis", "walk", "calm", "unwind",
                                    "mind", "anxi")),
    "How do I boil an egg?":
        Topic("boiling an egg", ("egg", "boil", "water", "pot", "minute", "shell", "yolk", "cook")),
    "What should I cook for a dinner party of six?":
        Topic("a dinner party", ("dinner", "cook", "dish", "meal", "guest", "recipe", "pasta", "chicken", "salad",
                                 "dessert", "party", "menu", "roast", "serve")),
    "How do I write a polite email to decline an invitation?":
        Topic("declining an invitation", ("email", "invit", "declin", "polite", "thank", "regret", "unfortunately",
                                          "sorry", "attend")),
    "What are some good stretches for a stiff back?":
        Topic("stretches for a stiff back", ("stretch", "back", "spine", "muscle", "pose", "yoga", "posture", "knee",
                                             "hip", "shoulder", "bend")),
    "How can I make my phone battery last longer?":
        Topic("phone battery life", ("battery", "phone", "charg", "screen", "bright", "app", "power", "setting", "wifi",
                                     "bluetooth")),
    "What should I do if my bike chain keeps slipping?":
        Topic("a slipping bike chain", ("chain", "bike", "bicycle", "gear", "derailleur", "cassette", "sprocket",
                                        "lubric", "oil", "tension", "shift", "mechanic")),
    "How do I organise a small closet?":
        Topic("organising a closet", ("closet", "organi", "shel", "hanger", "cloth", "storage", "bin", "space", "shoe",
                                      "fold", "drawer", "box")),
    "What's a good gift for a friend who likes cooking?":
        Topic("a gift for a cook", ("gift", "cook", "kitchen", "knife", "knives", "spice", "recipe", "pan", "book",
                                    "apron", "utensil", "chef")),
    "How do I get rid of fruit flies in the kitchen?":
        Topic("fruit flies", ("fly", "flies", "fruit", "vinegar", "trap", "kitchen", "trash", "garbage", "bin", "ripe",
                              "sink")),
    "How can I drink more water during the day?":
        Topic("drinking more water", ("water", "drink", "bottle", "hydrat", "glass", "sip", "thirst", "cup")),
    "How do I plan a budget for a holiday?":
        Topic("a holiday budget", ("budget", "holiday", "trip", "travel", "money", "cost", "spend", "sav", "flight",
                                   "hotel", "expense", "vacation")),
    "What's an easy way to start meditating?":
        Topic("meditation", ("meditat", "breath", "mind", "calm", "focus", "sit", "sitt", "minute", "relax", "quiet",
                             "attention")),
    "How do I keep bread fresh for longer?":
        Topic("keeping bread fresh", ("bread", "fresh", "loaf", "freez", "bag", "store", "stale", "wrap", "box",
                                      "fridge", "mold", "mould")),
    "How should I prepare for a long flight?":
        Topic("a long flight", ("flight", "fly", "plane", "travel", "seat", "pack", "sleep", "water", "hydrat",
                                "airport", "jet", "pillow")),
    "How do I remember people's names better?":
        Topic("remembering names", ("name", "remember", "memor", "repeat", "associat", "person", "people", "introduc")),
    "What's a simple pasta recipe for tonight?":
        Topic("a pasta recipe", ("pasta", "spaghetti", "sauce", "garlic", "tomato", "oil", "cheese", "parmesan", "boil",
                                 "noodle", "recipe", "cook")),
    "How can I keep my kids busy on a rainy day?":
        Topic("a rainy day with kids", ("kid", "child", "game", "craft", "rain", "play", "indoor", "draw", "paint",
                                        "puzzle", "book", "fort", "activit", "movie")),
    "How do I choose a good watermelon?":
        Topic("picking a watermelon", ("watermelon", "melon", "ripe", "spot", "heavy", "sound", "knock", "tap", "rind",
                                       "stripe", "weight")),
    "How do I fix a squeaky door?":
        Topic("a squeaky door", ("door", "hinge", "squeak", "oil", "lubric", "grease", "spray", "wd", "screw", "pin",
                                 "silicone")),
    "What's the best way to store fresh herbs?":
        Topic("storing fresh herbs", ("herb", "basil", "parsley", "cilantro", "mint", "water", "fridge", "refrigerat",
                                      "towel", "jar", "stem", "freez")),
    "How can I make my mornings less rushed?":
        Topic("calmer mornings", ("morning", "alarm", "wake", "night", "prepar", "routine", "breakfast", "earl", "plan",
                                  "schedule")),
    "How do I politely ask a neighbour to be quieter?":
        Topic("a noisy neighbour", ("neighbo", "nois", "quiet", "polite", "ask", "talk", "knock", "note", "loud",
                                    "music")),
    # Held out: only ever asked by the evaluation (side turns, never trained).
    "How do I make cold brew coffee at home?":
        Topic("cold brew coffee", ("coffee", "brew", "cold", "ground", "bean", "water", "steep", "fridge", "strain",
                                   "filter", "jar")),
    "What can I do to focus better while studying?":
        Topic("focusing while studying", ("focus", "stud", "concentrat", "distract", "break", "phone", "note", "learn",
                                          "pomodoro", "attention", "quiet", "exam")),
    "How do I pick a good avocado?":
        Topic("picking an avocado", ("avocado", "ripe", "soft", "firm", "squeez", "press", "skin", "stem", "colo",
                                     "green")),
    "How should I care for a new leather jacket?":
        Topic("leather jacket care", ("leather", "jacket", "condition", "clean", "cloth", "water", "store", "hang",
                                      "protect", "polish", "wipe")),
    "What's a nice way to spend a Sunday afternoon?":
        Topic("Sunday afternoons", ("sunday", "afternoon", "walk", "park", "read", "book", "relax", "friend", "family",
                                    "movie", "picnic", "cook", "nap", "garden", "museum", "hike", "outdoor",
                                    "weekend")),
    "How do I get better at public speaking?":
        Topic("public speaking", ("speak", "speech", "public", "audience", "practi", "present", "confiden", "talk",
                                  "nervous", "rehears", "voice")),
    "How can I keep my car clean inside?":
        Topic("a clean car interior", ("car", "clean", "vacuum", "seat", "interior", "trash", "mat", "wipe", "dust",
                                       "upholster", "dashboard", "vehicle")),
    "What should I eat before a morning workout?":
        Topic("eating before a workout", ("eat", "food", "workout", "exercis", "banana", "oat", "protein", "carb",
                                          "snack", "energy", "breakfast", "toast", "fruit", "meal", "egg", "yog",
                                          "oatm")),
}

QUESTIONS: tuple[str, ...] = tuple(TOPICS)[:36]
"""Everyday questions a personal assistant gets (asked while the users talk)."""
HELD_OUT: tuple[str, ...] = tuple(TOPICS)[36:]
"""Never asked during training: the before/after evaluation's questions."""

_SHORT_ENDINGS = frozenset({"s", "es", "'s", "ing", "ed", "d"})


def words(text: str) -> list[str]:
    """Lower-cased words (letters and digits, inner apostrophes kept); markup and punctuation dropped."""
    return _WORD.findall(text.lower())


def topic_of(question: str) -> Topic:
    """The question's topic. A question not listed here has no topic words (guessing them from the
    question would call fair answers off topic), so only the other rules apply to its replies."""
    return TOPICS.get(question) or Topic(question.rstrip("?").strip(), ())


def non_answer(question: str, reply: str, system: str = "") -> str | None:
    """Why a person would not take `reply` as an answer to `question`, or None when it is one.

    Returns one of "empty", "too short", "repeats the question" (the system prompt or the question
    again, and next to nothing else), "loops" (the same few words over and over) or "off topic" (none of
    the question's topic words).
    """
    said = words(reply)
    if not said:
        return "empty"
    if len(said) < MIN_WORDS:
        return "too short"
    if _echoes(said, words(system), words(question)):
        return "repeats the question"
    if len(said) >= 12 and len(set(said)) / len(said) < MIN_DISTINCT:
        return "loops"
    stems = topic_of(question).words
    if stems and not any(mentions(w, stem) for w in said for stem in stems):
        return "off topic"
    return None


def substantive(question: str, reply: str) -> bool:
    """Whether `reply` says something about the topic that the question did not: it mentions a
    topic word none of the question's own words matches ("ripe" or "skin" to "How do I pick a good
    avocado?", not "avocado"). Stricter than `non_answer`, which an on-topic reply passes by
    naming the question's nouns: "it's a great idea to choose the right kind of avocado for your
    diet" answers nothing. The evaluation reports it, as a floor under the preference numbers;
    the users complain on it only when told to (`SimulatedUser.wants_substance`), so by default
    training is not told about it.

    Read against the base's held-out replies in `docs/demo-runs/` (64 tokens, T=0.7): with seed 0,
    17 of 24 answer and pass, and none of the 6 that answer and fail says how to do the thing
    asked; with seed 1, 10 pass and 12 fail, two of them fairly (a French press for cold brew; an
    app and a night's sleep for studying), so it is a floor, not a grader. On 192 base replies
    (`base_rates --per-question 24`) 0.46 pass: on 24 replies the rate moves by +-0.1 by sampling
    alone. A question with no listed topic words, or whose own words match every one, cannot be
    judged: True.
    """
    asked = words(question)
    new = [stem for stem in topic_of(question).words if not any(mentions(w, stem) for w in asked)]
    return not new or any(mentions(w, stem) for w in words(reply) for stem in new)


def _echoes(said: list[str], system: list[str], question: list[str]) -> bool:
    """Most of the system prompt or of the question is in the reply, and the reply adds fewer than
    `MIN_NEW_WORDS` words of its own."""
    kept, known = set(said), set(system) | set(question)
    copied = any(source and sum(w in kept for w in source) >= ECHO_SHARE * len(source) for source in (system, question))
    return copied and sum(w not in known for w in said) < MIN_NEW_WORDS


def mentions(word: str, stem: str) -> bool:
    """Does a reply word say a topic word? Prefixes for longer stems, endings for short words."""
    if len(stem) > 3:
        return word.startswith(stem)
    return word == stem or (word.startswith(stem) and word[len(stem):] in _SHORT_ENDINGS)


def asked(question: str) -> str:
    """How a user points back at the question: "I asked about cold brew coffee." (or the question
    itself, for one not listed here)."""
    topic = TOPICS.get(question)
    return f"I asked about {topic.about}." if topic else f"I asked: {question}"
