"""The stricter answer check over stored demo runs, including those from before it existed.

    .venv/bin/python scripts/strict_answers.py docs/demo-runs/*.json

A demo run keeps every held-out reply verbatim (`before` and `after`), so the check can be run
again on them: for each run, before -> after, the share of replies that answer the question
(the users' verdict, `questions.non_answer`, as stored), the share that also say something the
question did not (`questions.substantive`), and the headline (preferred and sane) beside the same headline with
that check added. Numbers only: no model is loaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from clawr1.demo.questions import substantive


def rates(replies: list[dict[str, Any]]) -> dict[str, float]:
    n = len(replies)
    answers = [r["non_answer"] is None for r in replies]  # the user's verdict, as the run stored it
    strict = [a and substantive(r["question"], r["text"]) for a, r in zip(answers, replies)]
    kept = [r["preferred"] and bool(r["sane"]) for r in replies]
    return {"answered": sum(answers) / n, "substantive": sum(strict) / n, "preferred_and_sane": sum(kept) / n,
            "preferred_sane_substantive": sum(k and s for k, s in zip(kept, strict)) / n, "n": n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="demo.json files (`docs/demo-runs/*.json`)")
    args = parser.parse_args()
    table = Table(title="held-out replies, before -> after (each run's base, then its last version)")
    for column in ("run", "version", "answered", "and substantive", "preferred and sane", "... and substantive"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for path in args.runs:
        result = json.loads(path.read_text())
        if not (result.get("before") and result.get("after")):
            continue
        before, after = rates(result["before"]["replies"]), rates(result["after"]["replies"])
        table.add_row(path.stem, f"v{result['reached_version']}",
                      *(f"{before[k]:.2f} -> {after[k]:.2f}" for k in
                        ("answered", "substantive", "preferred_and_sane", "preferred_sane_substantive")))
    Console().print(table)


if __name__ == "__main__":
    main()
