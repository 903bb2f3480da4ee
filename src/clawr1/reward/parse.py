"""Reading judge outputs: votes, their majority, hints and the choice among hint votes.

Parsers never raise: a model's output is data, and what cannot be read counts as 0 (votes) or
`unparsable` (hints), so a confused judge masks a sample instead of training on noise.
"""

from __future__ import annotations

import re
from collections import Counter
from itertools import pairwise

from clawr1.reward.types import HintReason, HintResult

# "Score: +1", "score = -1", "**Score:** 0", "Score: 1" (unsigned 1 reads as +1); not "Score: 10", and
# not "Score: 1 or ..." / "+1/-1": those echo the answer options instead of choosing one.
_ECHO = r"(?:\.0+)?(?![\d.]*\d)(?!\s*(?:or\b|/))"
_SCORE = re.compile(r"score\W{0,4}?\s*[:=]?\s*\**\s*([+-]?)\s*([01])" + _ECHO, re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{\s*([+-]?)\s*([01])\s*\}")
_SCORE_ENDS = re.compile(r"score\W{0,4}?\s*[:=]?\s*\**\s*$", re.IGNORECASE)  # "Score:" and nothing after
_BARE = re.compile(r"^\s*([+-]?)\s*([01])" + _ECHO)  # a bare answer, e.g. "+1"
_OPTIONS = re.compile(r"[+-]?[01]\s*(?:or|/)\s*(?:score\W*)?[+-]?[01]", re.IGNORECASE)
_HINT = re.compile(r"\[\s*HINT[_ ]?START\s*\](.*?)(?:\[\s*/?\s*HINT[_ ]?END\s*\]|$)", re.IGNORECASE | re.DOTALL)
_START = re.compile(r"\[\s*HINT[_ ]?START\s*\]", re.IGNORECASE)
_NONE = re.compile(r"^\W*(?:none|no|n/a|nothing|no correction)\b\W*$", re.IGNORECASE)
# Between the markers, a sentence that says there is nothing to correct ("No correction needed,
# the user was satisfied."), as opposed to a correction that starts with "No" ("No bold, please.").
_NO_HINT = re.compile(r"^\W*(?:no (?:concrete |specific |clear )?(?:correction|hint|feedback)s?\b|there (?:is|was|are) "
                      r"no (?:concrete |specific |clear )?(?:correction|hint)s?\b|nothing to (?:correct|fix)\b)",
                      re.IGNORECASE)
_SAYS_NO = re.compile(r"^\W*(?:no\b|none\b|no correction|there is no (?:concrete )?correction)", re.IGNORECASE)
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")
HINT_MAX_CHARS = 600


def _value(sign: str, digit: str) -> int:
    if digit == "0":
        return 0
    return -1 if sign == "-" else 1


def parse_vote(text: str) -> int | None:
    """A vote's score, or None when unparsable. The last line that names one score decides; a line
    that lists options ("Score: +1 or Score: -1", "+1/-1") or names two scores chooses nothing."""
    for line in reversed(text.strip().splitlines() or [""]):
        if _OPTIONS.search(line):
            continue  # lists the options ("+1 or -1"), chooses none of them
        found = {_value(s, d) for s, d in _SCORE.findall(line)} | {_value(s, d) for s, d in _BOXED.findall(line)}
        if len(found) == 1:
            return found.pop()
        if len(found) > 1:
            return None
    # "Score:" ending one line and the vote alone on the next (the embedded judge continues the
    # prompt's "Score:", and may start with a newline); the last such pair decides.
    lines = [line for line in text.splitlines() if line.strip()]
    for above, line in reversed(list(pairwise(lines))):
        bare = _BARE.match(line)
        if _SCORE_ENDS.search(above) and bare and not _OPTIONS.search(line):
            return _value(bare.group(1), bare.group(2))
    bare = _BARE.match(text)
    return _value(bare.group(1), bare.group(2)) if bare else None


def vote_of(text: str) -> int:
    """The vote that counts: unparsable is 0."""
    vote = parse_vote(text)
    return 0 if vote is None else vote


def majority(votes: list[int]) -> tuple[int, int]:
    """(winner, its count): the most common vote; a tie for first place gives 0."""
    if not votes:
        return 0, 0
    ranked = Counter(votes).most_common()
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        return 0, ranked[0][1]
    return ranked[0]


def describe_majority(votes: list[int], unparsable: int) -> str:
    """`judge majority 2/3 (+1)`, `judge tie (+1, -1, 0) -> 0`, plus how many votes were unreadable."""
    score, count = majority(votes)
    ranked = Counter(votes).most_common()
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        text = f"judge tie ({', '.join(_signed(v) for v in votes)}) -> 0"
    else:
        text = f"judge majority {count}/{len(votes)} ({_signed(score)})"
    return text + (f", {unparsable} unparsable" if unparsable else "")


def _signed(vote: int) -> str:
    return f"{vote:+d}" if vote else "0"


def _trim(hint: str) -> str:
    """Whitespace collapsed; a hint cut off by the token limit ends at its last full sentence."""
    hint = " ".join(hint.split())
    if len(hint) > HINT_MAX_CHARS:
        hint = hint[:HINT_MAX_CHARS]
    ends = list(_SENTENCE_END.finditer(hint))
    if ends and ends[-1].end() < len(hint):
        hint = hint[: ends[-1].end()]
    return hint.strip()


def parse_hint(text: str) -> tuple[str | None, HintReason | None]:
    """(hint, None) when the output holds a hint between the markers; (None, "no_correction") when it
    says there is none; (None, "unparsable") otherwise. Length is checked in `select_hint`."""
    found = _HINT.search(text)
    if found is None:
        return (None, "no_correction") if _SAYS_NO.match(text) else (None, "unparsable")
    body = found.group(1)
    again = _START.search(body)
    if again:  # the model started a second hint (it loops): the first one is the answer
        body = body[: again.start()]
    hint = _trim(body)
    if not hint:
        return None, "unparsable"
    if _NONE.match(hint) or _NO_HINT.match(hint):
        return None, "no_correction"
    return hint, None


def select_hint(raw: list[str], min_chars: int) -> HintResult:
    """The longest hint of at least `min_chars`; else why not: too_short (a hint was offered but
    every one was short) before no_correction (some vote said none) before unparsable."""
    parsed = [parse_hint(text) for text in raw]
    hints = [hint for hint, _ in parsed if hint is not None]
    long_enough = [hint for hint in hints if len(hint) >= min_chars]
    if long_enough:
        return HintResult(max(long_enough, key=len), None, list(raw))
    if hints:
        return HintResult(None, "too_short", list(raw))
    if any(reason == "no_correction" for _, reason in parsed):
        return HintResult(None, "no_correction", list(raw))
    return HintResult(None, "unparsable", list(raw))
