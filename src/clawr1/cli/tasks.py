"""`clawr1 tasks`: the task families (`clawr1 tasks` lists them, `clawr1 tasks FAMILY --split heldout`
writes one as JSONL), and `clawr1 eval --tasks FILE|FAMILY`: held-out success per family, with
95% intervals and the quality of the replies, of the served version beside the base.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from clawr1.core.config import Config

console = Console()
err_console = Console(stderr=True)


def add_arguments(sub: Any, common: Any) -> None:
    p = sub.add_parser("tasks", help="task families generated from templates: list them, or write one as JSONL")
    common(p)
    p.add_argument("family", nargs="?", help="a family name (none: list the families and their split sizes)")
    p.add_argument("--split", choices=["train", "heldout"], default="train")
    p.add_argument("-n", type=int, help="how many tasks (default: the split's size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="the JSONL file (default: standard output)")
    p.set_defaults(fn=cmd_tasks)


def eval_arguments(p: argparse.ArgumentParser) -> None:
    """The task flags of `clawr1 eval`."""
    p.add_argument("--tasks", help="evaluate on tasks: a JSONL file, a shipped set, or families (comma-separated; "
                   "'all': every family) instead of the personal scenario")
    p.add_argument("--split", choices=["train", "heldout"], help="with family --tasks: the split (default heldout)")
    p.add_argument("-n", type=int, help="with family --tasks: tasks per family (default: the split's size)")
    p.add_argument("--max-turns", type=int, default=6, help="with --tasks: model calls per task (default 6)")
    p.add_argument("--concurrency", type=int, default=4, help="with --tasks: tasks at once (default 4)")


def cmd_tasks(args: argparse.Namespace, config: Config) -> int:
    from clawr1.envs.families import generate, registry

    if not args.family:
        table = Table("family", "env", "train", "held out", "what", title="task families (clawr1 tasks FAMILY)")
        for fam in registry().values():
            table.add_row(fam.name, fam.env, str(fam.train_size), str(fam.heldout_size), fam.doc)
        console.print(table)
        return 0
    tasks = generate(args.family, args.split, args.n, args.seed)
    lines = "".join(json.dumps(asdict(t)) + "\n" for t in tasks)
    if args.out:
        args.out.write_text(lines, encoding="utf-8")
        err_console.print(f"{len(tasks)} tasks written to {args.out}")
    else:
        sys.stdout.write(lines)
    return 0


def eval_tasks(args: argparse.Namespace, config: Config, base: str, key: str) -> int:
    from clawr1.envs import task_set
    from clawr1.flows.evaluate import evaluate_tasks, mistakes_text

    tasks = task_set(args.tasks, args.split, args.n, default_split="heldout")
    with Progress(console=err_console, transient=True) as bar:
        job = bar.add_task("tasks (served, then base)", total=2 * len(tasks))
        result = evaluate_tasks(base, key, tasks, max_turns=args.max_turns, max_tokens=args.max_tokens,
                                temperature=args.temperature, concurrency=args.concurrency,
                                progress=lambda: bar.advance(job)).as_dict()
    table = Table("tasks", "n", "served: success [95% CI]", "sane", "tool errors", "base: success [95% CI]", "sane",
                  title=f"task evaluation ({args.tasks}, {args.split or 'heldout'}): side turns, never trained")
    served, base_stats = result["served"], result["base"]
    rows = [("all", served, base_stats)]
    rows += [(f, s, base_stats["by_family"][f]) for f, s in served["by_family"].items()]
    rows += [(f"  {f}", s, base_stats["by_level"][f]) for f, s in served["by_level"].items()]
    for label, s, b in rows:
        table.add_row(label, str(s["n"]), _rate(s), _num(s["sane_rate"]), _num(s["tool_error_share"]), _rate(b),
                      _num(b["sane_rate"]))
    console.print(table)
    console.print("served versions: " + ", ".join(f"{v} ({n})" for v, n in served["versions"].items()))
    for who, s in (("served", served), ("base", base_stats)):
        console.print(f"{who}, form failures per model call: {mistakes_text(s)}")
    if result["quality_error"]:
        console.print(f"[yellow]quality not measured:[/yellow] {result['quality_error']}")
    if args.json:
        print(json.dumps(result))
    return 0


def _rate(s: dict[str, Any]) -> str:
    return f"{s['success']:.2f} [{s['ci95'][0]:.2f}, {s['ci95'][1]:.2f}]"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
