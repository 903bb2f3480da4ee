"""The judge's accuracy on labels it never saw: the demo's simulated users know whether each reply
they wrote was a correction (a complaint, a cut-off, a non-answer) or thanks, and their wordings
are not in the judge's training or labelled sets. `python -m clawr1.demo.judge_check POOL_DIR...`
reads the pools of finished demo runs and compares every judge verdict with the user's label.

The label comes from the text the user sent (the demo's templates: thanks open with one of
`THANKS`, everything else is a correction), so it needs no record of the users' state.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

from clawr1.core.config import PoolConfig
from clawr1.core.messages import text_of
from clawr1.datapool import DataPool, SQLitePool
from clawr1.demo.users import THANKS

JUDGES = ("classifier", "judge")  # reward sources of judge verdicts (the LLM judge's is "judge"; not rules,
# feedback or outcomes)


def user_label(next_state: list[dict[str, Any]]) -> int | None:
    """+1 when the user's reply to the turn was thanks, -1 when it was a correction, None when the
    next state holds no user message (a tool's output, or nothing)."""
    users = [m for m in next_state if m.get("role") == "user"]
    if not users:
        return None
    text = text_of(users[-1].get("content"), "content").strip()
    return 1 if text.startswith(THANKS) else -1


def confusion(pool: DataPool, sessions: int = 100_000) -> Counter[tuple[int, float]]:
    """(user's label, judge's score) counts over every judged main turn with a next state."""
    out: Counter[tuple[int, float]] = Counter()
    for session in pool.sessions(limit=sessions):
        steps = [s for s in pool.show(session["session_id"], session["tenant"], "session")["steps"] if s.get("turn_type", "main") == "main"]
        for step in pool.get_steps([s["step_id"] for s in steps]):
            label = user_label(step.next_state or [])
            verdicts = [r for r in pool.show(step.step_id, kind="step")["rewards"] if r["source"] in JUDGES]
            if label is not None and verdicts:
                out[(label, float(verdicts[-1]["score"]))] += 1
    return out


def summary(counts: Counter[tuple[int, float]]) -> dict[str, Any]:
    """Accuracy over decided verdicts (0 = abstained), the abstention rate, and per label recall."""
    n = sum(counts.values())
    decided = sum(v for (_, score), v in counts.items() if score != 0)
    right = sum(v for (label, score), v in counts.items() if score == label)
    recall = {label: sum(v for (lab, s), v in counts.items() if lab == label and s == label)
              / max(sum(v for (lab, _), v in counts.items() if lab == label), 1) for label in (1, -1)}
    return {"judged": n, "accuracy": right / max(decided, 1), "abstained": (n - decided) / max(n, 1),
            "recall_thanks": recall[1], "recall_corrections": recall[-1],
            "confusion": {f"{label:+d} judged {score:+.0f}": v for (label, score), v in sorted(counts.items())}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pools", nargs="+", type=Path, help="data directories holding a demo run's pool.sqlite3")
    args = parser.parse_args(argv)
    total: Counter[tuple[int, float]] = Counter()
    for folder in args.pools:
        with SQLitePool(folder, PoolConfig()) as pool:
            counts = confusion(pool)
        total += counts
        print(folder, summary(counts))
    if len(args.pools) > 1:
        print("all", summary(total))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
