"""The shipped, hand-written turn sets: `train` (the classifier learns from it; prompts were tuned
on it) and `next_states` (the evaluation set of `clawr1 bench judge`). The two share no wording.

Each line: {"id", "category", "label" (+1/-1/0), "correction" (does the next state say concretely
what to change?), "context" (the request messages), "reply" (text), "next_state" (messages)}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from clawr1.reward.types import Message

CATEGORIES = frozenset({"correction", "retry", "tool_error", "tool_success", "thanks", "moving_on", "ambiguous"})


@dataclass(frozen=True)
class Item:
    id: str
    category: str
    label: int
    correction: bool
    context: list[Message]
    reply: str
    next_state: list[Message]


def _item(data: dict[str, Any], where: str) -> Item:
    item = Item(id=str(data["id"]), category=str(data["category"]), label=int(data["label"]),
                correction=bool(data["correction"]), context=list(data["context"]), reply=str(data["reply"]),
                next_state=list(data["next_state"]))
    if item.label not in (-1, 0, 1) or item.category not in CATEGORIES or not item.next_state:
        raise ValueError(f"{where}: bad item {item.id!r} (label, category or empty next_state)")
    return item


def load_items(name: str) -> list[Item]:
    """`train` or `next_states`, from the package's data folder."""
    text = (resources.files("clawr1.reward") / "data" / f"{name}.jsonl").read_text(encoding="utf-8")
    return [_item(json.loads(line), f"{name}.jsonl:{n}") for n, line in enumerate(text.splitlines(), 1) if line.strip()]
