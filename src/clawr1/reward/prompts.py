"""The judge's two prompts: the vote (did the reply succeed, from what came next?) and the hint
(does what came next say concretely what to do differently?).

Both are short and end with an answer prefix (a trailing assistant message), because the embedded
135M model rarely produces a parsable answer on its own but does continue `Score:`. Each field is
clipped (head + tail): on CPU the judge's cost is prefill (~100 tokens/s on 2 busy cores), so
a typical prompt is ~150 tokens and no turn makes one much longer than ~400.
"""

from __future__ import annotations

from clawr1.reward.turn import clip, next_state_text, task_of
from clawr1.reward.types import Message

TASK_CHARS = 300
REPLY_CHARS = 300
NEXT_CHARS = 500

HINT_START = "[HINT_START]"
HINT_END = "[HINT_END]"
VOTE_PREFIX = "Score:"

JUDGE_SYSTEM = "You grade an AI assistant's reply by what came next."
JUDGE_QUESTION = (
    "Did the reply succeed? +1 = the user thanks, accepts or moves on, or the tool worked. "
    "-1 = the user corrects, complains, retries or rephrases, or the tool failed. 0 = unclear.\n"
    "Answer: Score: +1, Score: -1 or Score: 0."
)

HINT_SYSTEM = "You turn feedback on an AI assistant's reply into a hint for redoing it."
HINT_QUESTION = (
    "Does Next say concretely what the reply should have done differently? If yes, write a 1-3 sentence "
    f"hint for redoing it between {HINT_START} and {HINT_END}. If not (thanks, a new request, a vague "
    f"complaint), answer {HINT_START} NONE {HINT_END}."
)


def turn_block(context: list[Message], reply: str, next_state: list[Message]) -> str:
    """The turn as the judge reads it: the task, the reply, and the next state with its roles."""
    return (
        f"Request: {clip(task_of(context), TASK_CHARS) or '(none)'}\n"
        f"Reply: {clip(reply, REPLY_CHARS) or '(empty)'}\n"
        f"Next:\n{next_state_text(next_state, NEXT_CHARS)}"
    )


def judge_messages(context: list[Message], reply: str, next_state: list[Message]) -> list[Message]:
    """Messages for one vote; they end with the answer prefix `Score:`."""
    return [
        {"role": "system", "content": JUDGE_SYSTEM},
        {"role": "user", "content": f"{turn_block(context, reply, next_state)}\n\n{JUDGE_QUESTION}"},
        {"role": "assistant", "content": VOTE_PREFIX},
    ]


def hint_messages(context: list[Message], reply: str, next_state: list[Message]) -> list[Message]:
    """Messages for one hint vote; they end with the answer prefix `[HINT_START]`."""
    return [
        {"role": "system", "content": HINT_SYSTEM},
        {"role": "user", "content": f"{turn_block(context, reply, next_state)}\n\n{HINT_QUESTION}"},
        {"role": "assistant", "content": HINT_START},
    ]
