"""What one reply is measured on, and the pure maths of each measure.

A preference score can reach 1.00 while the replies turn into nonsense ("You're right." to "How
do I fix a squeaky door?"), so every learning number needs a quality number beside it. Each reply
gets four measures that need no labels and no judge:

- relevance: cosine of the MiniLM embeddings of the request (the last user message and the one
  before it: `request_text`) and the reply. Catches off-topic replies, however fluent (a copied
  system prompt, a canned "You're right.").
- fluency: the *base* model's mean logprob per reply token, teacher-forced with no adapter under
  its own distribution (temperature 1, uncut), whatever the reply was sampled with: "would the
  base say this at all", not "is it what the base would most likely say" (under a sharpened
  distribution a fluent reply in another style than the base's favourite looks improbable; see
  `QualityMeter._score`). Its calibration comes from base replies to the same requests sampled
  the same way. Catches broken language ("DEAD BO *this part is just in the image") that a
  drifted policy finds likely but the model it started from does not.
- repetition: the share of word 3-grams that repeat an earlier one. Word n-grams, not token
  n-grams: they are what the user reads and they do not depend on the tokenizer, so a
  calibration means the same on every engine. Catches loops ("the the the ...").
- drift (when the serving version's behaviour logprobs are known): KL(version || base) per token,
  estimated on the reply's own tokens as mean(logp_version - logp_base) (the tokens were sampled
  from the version, so this is the Monte-Carlo estimate of the KL), and the entropy estimate
  -mean(logp_version). Both at the temperature the reply was sampled at, which is what the
  behaviour logprobs are of.

An empty or whitespace-only reply is never sane, whatever its numbers; nor is an echo (a reply
whose content words are the request's own: relevance near 1.0, fluent, nothing repeated, and it
says nothing: the question asked back or restated), nor a bare refusal. The base model's own
likely wordings of both passed every other measure (a review, 2026-12-06: "There are many ways
to keep basil fresh, but I'm afraid I'm unable to provide that." was sane on all 12 probes). Nor
is a reply that switches into a script its request has none of (`foreign_script`: Chinese words
inside an English answer, which Qwen2.5 wrote once trained away from its base, 2026-12-06).
"""

from __future__ import annotations

import collections
import math
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from clawr1.core.messages import text_of
from clawr1.core.types import Generation

NGRAM = 3
_WORD = re.compile(r"\w+(?:'\w+)*")


@dataclass(frozen=True)
class Reply:
    """One reply to measure, exactly as it was served.

    `token_ids` are the reply's sampled ids (with the final end-of-turn token when there was one)
    and `prompt_ids` the ids it was sampled after. `logprobs`, when given, are the serving
    version's behaviour logprobs of `token_ids` at `temperature` (the scoring temperature: 1 for
    greedy); they enable the drift measures.
    """

    messages: list[dict[str, Any]]
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    logprobs: list[float] | None = None
    temperature: float = 1.0
    top_k: int = 0  # with `top_p`: the cut of the distribution the reply was sampled from (`engine/sampling.py`)
    top_p: float = 1.0
    # The reply is a tool call (its text the call as the model wrote it), not prose for a reader:
    # relevance and echo say nothing about it (a level-0 task asks for the very line it was given).
    tool_call: bool = False

    def __post_init__(self) -> None:
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.logprobs)} behaviour logprobs")
        if not 0 < self.temperature <= 2:
            raise ValueError(f"temperature must be in (0, 2] (the scoring temperature), got {self.temperature}")

    @classmethod
    def from_generation(cls, messages: list[dict[str, Any]], gen: Generation, drift: bool = True,
                        parse: Callable[..., Any] | None = None, tools: list[dict[str, Any]] | None = None) -> Reply:
        """A reply from an engine's Generation; `drift=False` drops the behaviour logprobs (base replies
        measured for calibration need no KL, and skipping it saves a scoring pass when T != 1).
        `parse` (an engine's) and the request's `tools`: measured as `measured_text` says."""
        text, call = measured_text(parse, gen.content, tools) if parse else (gen.content, False)
        return cls(messages, text, list(gen.token_ids), list(gen.prompt_ids),
                   list(gen.logprobs) if drift else None, gen.temperature, gen.top_k, gen.top_p, call)

    @property
    def empty(self) -> bool:
        return not self.text.strip()


def measured_text(parse: Callable[..., Any], text: str, tools: list[dict[str, Any]] | None) -> tuple[str, bool]:
    """What a reply is measured as, and whether it is a tool call: its content as the client gets it
    (`parse`: an engine's), or, for a reply that is only a call (no content), the call as the model
    wrote it (an agent's last turn, a probe replayed from an agent's turn)."""
    content = parse(text, tools).content
    return (text, True) if content is None else (content, False)


@dataclass(frozen=True)
class Quality:
    """The measures of one reply. `fluency` is None only when the reply has no tokens to score;
    `kl` and `entropy` are None when no behaviour logprobs were given (nats per token)."""

    relevance: float
    fluency: float | None
    repetition: float
    empty: bool
    n_tokens: int
    kl: float | None = None
    entropy: float | None = None
    echo: bool = False  # `echoes`: the reply says nothing the request did not
    refusal: bool = False  # `refuses`: the reply declines and gives nothing else
    foreign: bool = False  # `foreign_script`: it writes in a script the request does not
    tool_call: bool = False  # `Reply.tool_call`: relevance is not held against it

    def to_dict(self) -> dict[str, Any]:
        return {"relevance": self.relevance, "fluency": self.fluency, "repetition": self.repetition,
                "empty": self.empty, "n_tokens": self.n_tokens, "kl": self.kl, "entropy": self.entropy,
                "echo": self.echo, "refusal": self.refusal, "foreign": self.foreign, "tool_call": self.tool_call}


TOPIC_TURNS = 2  # user messages a request's topic is read from


def request_text(messages: Sequence[dict[str, Any]]) -> str:
    """What the reply should be about: the last user message, then the one before it. In a
    conversation the last message is often only a reaction ("Too long, please keep it short.",
    "That doesn't answer my question.") and the topic is in the turn before; the last comes first,
    so when the embedder truncates, it keeps the newest."""
    texts = [text_of(messages[i].get("content"), f"messages[{i}].content")
             for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "user"][:TOPIC_TURNS]
    if not texts:
        raise ValueError("a reply's relevance needs a user message in its request")
    return "\n".join(texts)


def words(text: str) -> list[str]:
    """Lower-cased words (letters, digits, inner apostrophes); punctuation and markup are dropped."""
    return [w.lower() for w in _WORD.findall(text)]


ECHO_SHARE = 0.9  # a reply this much of whose content words are the request's repeats it
# Words that carry no content of their own: function words, and the frames a reply restates a
# question in ("So you want to know how to ...?", "There are many ways to ...").
FRAME_WORDS = frozenset("""
a an the and or but if so then than that this these those it its it's i i'm i'd i'll i've me my
you you're you'd you'll your we we're our they they're their he she his her is are was were be
been being am do does did doing done have has had can could will would shall should may might
must to of in on at by for with about from into over under up down out off as not no how what
when where which who whom why whether there here want wants wanted know knows knowing wonder
wondering ask asks asking asked question questions like many ways way some any lot lots great
good sure ok okay yes well just really
""".split())  # noqa: SIM905 (a word list reads better as text)
REFUSAL = re.compile(  # ’ too: models write typographic apostrophes
    r"\b(?:i|we)(?: a|['’])m (?:sorry|afraid)\b.{0,40}\b(?:can(?:no|['’])t|unable|not able)\b"
    r"|\b(?:i|we) (?:can(?:no|['’])t|cannot|(?:a|['’])m unable to|(?:a|['’])m not able to|won['’]t be able to) "
    r"(?:help|assist|provide|answer|do|give|share|tell|offer)\b"
    r"|\bunable to (?:help|assist|provide|answer|give|offer)\b", re.IGNORECASE)
REFUSAL_MAX_NEW = 8  # a refusal with this many new content words or more is a hedge before an answer


def content_words(text: str) -> list[str]:
    """The words of `text` that say something (`FRAME_WORDS` dropped)."""
    return [w for w in words(text) if w not in FRAME_WORDS]


def echoes(reply: str, request: str) -> bool:
    """The reply says nothing the request did not: three words or more, and at least `ECHO_SHARE`
    of its content words (none at all included) are the request's. The question asked back ("So
    you want to know how to make cold brew at home?") and the question restated ("There are many
    ways to make a small apartment feel bigger.") add only frame words; "To pick a ripe avocado,
    press it gently" adds "ripe", "press", "gently"."""
    said = words(reply)
    if len(said) < 3:
        return False
    asked = set(words(request))
    content = [word for word in said if word not in FRAME_WORDS]
    return sum(word in asked for word in content) >= ECHO_SHARE * len(content)


def refuses(reply: str, request: str) -> bool:
    """A refusal ("I'm sorry, but I can't help with that.", "..., but I'm afraid I'm unable to
    provide that.") that gives nothing else: fewer than `REFUSAL_MAX_NEW` content words the
    request did not have. An everyday question refused is not an answer, however fluent."""
    if REFUSAL.search(reply) is None:
        return False
    asked = set(words(request))
    return len({w for w in content_words(reply) if w not in asked}) < REFUSAL_MAX_NEW


FOREIGN_MIN = 2  # letters of another script that make a reply foreign (one is a name, a symbol, a quote)


def scripts(text: str) -> collections.Counter[str]:
    """Letters of each script other than Latin (and Greek, which mathematics borrows), by the first
    word of their Unicode name: CJK, HIRAGANA, HANGUL, CYRILLIC, ARABIC, ..."""
    out: collections.Counter[str] = collections.Counter()
    for ch in text:
        if ord(ch) > 0x24F and ch.isalpha():
            script = unicodedata.name(ch, "UNKNOWN").split(" ")[0]
            if script not in ("LATIN", "GREEK"):
                out[script] += 1
    return out


def foreign_script(reply: str, request: str) -> bool:
    """The reply writes in a script the request has none of: a model drifting into another language
    of its pretraining ("**Eco-Friendly能源**: Design your space with solar panels", Qwen2.5 trained
    away from its base). A user who writes Chinese may be answered in it."""
    asked = scripts(request)
    return any(n >= FOREIGN_MIN and script not in asked for script, n in scripts(reply).items())


def repetition(text: str, n: int = NGRAM) -> float:
    """Share of word n-grams that repeat an earlier n-gram: 1 - distinct / total.

    0 for a reply of fewer than n words (nothing to repeat); "the the the the the" (three 3-grams,
    one distinct) gives 2/3, and a long loop tends to 1.
    """
    w = words(text)
    grams = [tuple(w[i:i + n]) for i in range(len(w) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def mean(values: Sequence[float]) -> float:
    """Arithmetic mean; raises on an empty sequence (an empty mean is a caller bug, not 0)."""
    if not values:
        raise ValueError("mean of nothing")
    return math.fsum(values) / len(values)


def fluency(base_logprobs: Sequence[float]) -> float:
    """The base model's mean logprob per reply token (temperature 1)."""
    return mean(base_logprobs)


def kl_estimate(version_logprobs: Sequence[float], base_logprobs: Sequence[float]) -> float:
    """KL(version || base) per token, estimated on tokens sampled from the version: mean(lp_v - lp_b)."""
    if len(version_logprobs) != len(base_logprobs):
        raise ValueError(f"{len(version_logprobs)} version logprobs but {len(base_logprobs)} base logprobs")
    return mean([v - b for v, b in zip(version_logprobs, base_logprobs)])


def entropy_estimate(version_logprobs: Sequence[float]) -> float:
    """The version's entropy per token, estimated on its own samples: -mean(lp_v)."""
    return -mean(version_logprobs)
