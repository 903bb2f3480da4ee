"""`clawr1 export`: the pool's main turns as a training set TRL reads (conversational
`prompt`/`completion` with `reward` and `hint`), filtered by tenant, time, reward and policy version.

`clawr1 pool export` stays as it was (jsonl/parquet, `--rewarded-only`); both go through
`DataPool.export`, this one with an `ExportFilter`.
"""

from __future__ import annotations

import argparse
import json
import re
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from clawr1.core.config import Config
from clawr1.datapool.base import EXPORT_FORMATS, ExportFilter

err_console = Console(stderr=True)
_SECONDS = re.compile(r"\d+(\.\d*)?")
_LOADERS = {"jsonl": "datasets.load_dataset('json', data_files={out!r})",
            "parquet": "datasets.load_dataset('parquet', data_files={out!r})",
            "hf": "datasets.load_from_disk({out!r})"}


def parse_time(text: str) -> float:
    """Unix seconds (`1767225600`, `1767225600.5`) or ISO 8601 (`2026-11-30`, `2026-11-30T04:00`,
    with an offset or `Z`; without one it is UTC)."""
    if _SECONDS.fullmatch(text.strip()):
        return float(text)
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is neither unix seconds nor an ISO 8601 time") from error
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def parse_versions(text: str) -> tuple[int | None, int | None]:
    """`3` (exactly v3), `2:5` (v2 to v5, inclusive), `2:` (v2 and later), `:5` (up to v5)."""
    low, sep, high = text.partition(":")
    try:
        bounds = (int(low) if low.strip() else None, int(high) if high.strip() else None)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--version takes N, A:B, A: or :B (policy versions), got {text!r}") \
            from error
    if not sep:
        bounds = (bounds[0], bounds[0])
    if bounds == (None, None) or any(v is not None and v < 0 for v in bounds):
        raise argparse.ArgumentTypeError(f"--version takes N, A:B, A: or :B with versions >= 0, got {text!r}")
    return bounds


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=EXPORT_FORMATS, default="jsonl",
                   help="jsonl or parquet (one file), or hf (a datasets.save_to_disk directory)")
    p.add_argument("--out", type=Path, help="where to write (default clawr1-export.jsonl / .parquet / clawr1-export-hf)")
    p.add_argument("--tenant", help="only this tenant's turns")
    p.add_argument("--since", type=parse_time, help="recorded at or after: ISO 8601 (UTC unless it says) or unix seconds")
    p.add_argument("--until", type=parse_time, help="recorded before: ISO 8601 or unix seconds")
    p.add_argument("--min-reward", type=float, help="reward >= this (implies rewarded)")
    p.add_argument("--max-reward", type=float, help="reward <= this (implies rewarded)")
    p.add_argument("--rewarded-only", action="store_true", help="only samples with a reward")
    p.add_argument("--version", type=parse_versions, metavar="N|A:B",
                   help="policy version that produced the turn: N, or a range A:B, A: or :B (inclusive)")
    p.add_argument("--json", action="store_true", help="print {rows, out} as JSON")


def cmd_export(args: argparse.Namespace, config: Config) -> int:
    from clawr1.datapool import open_existing_pool

    low, high = args.version or (None, None)
    try:
        filters = ExportFilter(tenant=args.tenant, since=args.since, until=args.until, min_reward=args.min_reward,
                               max_reward=args.max_reward, rewarded_only=args.rewarded_only, min_version=low,
                               max_version=high)
    except ValueError as exc:
        err_console.print(f"[red]error:[/red] {exc}")
        return 2
    out = args.out or Path("clawr1-export-hf" if args.format == "hf" else f"clawr1-export.{args.format}")
    with open_existing_pool(config) as pool:
        try:
            with err_console.status(f"Exporting to {out} ..."):
                rows = pool.export(out, args.format, filters=filters)
        except FileExistsError as exc:
            err_console.print(f"[red]error:[/red] {exc}")
            return 1
    if args.json:
        print(json.dumps({"rows": rows, "out": str(out), "format": args.format}))
    err_console.print(f"{rows} rows -> {out} (load with {_LOADERS[args.format].format(out=str(out))})")
    return 0
