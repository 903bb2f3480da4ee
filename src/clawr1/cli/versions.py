"""`clawr1 versions`, `clawr1 rollback N`, `clawr1 pin N` / `clawr1 pin --off`: the policy versions
the guard promoted or rejected (and why, with their probe scores), and the admin's two levers.

Both levers write the adapter's `CONTROL` file in the version store (`engine/adapters.py`), which
the gateway's guard and the trainer both read: nothing needs to be running, and a running `clawr1
up` applies them within a poll. The same actions are on the dashboard for the admin.
"""

from __future__ import annotations

import argparse
import json
import uuid
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from clawr1.core.config import Config
from clawr1.core.records import adapter_name
from clawr1.engine import adapters as store

console = Console()


def add_arguments(sub: Any, common: Any) -> None:
    p = sub.add_parser("versions", help="policy versions: promoted or rejected by the guard, why, their scores")
    common(p)
    p.add_argument("--tenant", help="a tenant's own adapter (tenants.adapter_per_tenant)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_refusing(cmd_versions))
    p = sub.add_parser("rollback", help="serve version N again and train on from it")
    common(p)
    p.add_argument("version", type=int)
    p.add_argument("--tenant")
    p.set_defaults(fn=_refusing(cmd_rollback))
    p = sub.add_parser("pin", help="serve version N whatever the guard promotes (--off: serve the newest promoted)")
    common(p)
    p.add_argument("version", type=int, nargs="?")
    p.add_argument("--off", action="store_true")
    p.add_argument("--tenant")
    p.set_defaults(fn=_refusing(cmd_pin))


class Refused(ValueError):
    """An admin action that cannot be done as asked (printed, exit code 2)."""


def _where(config: Config, tenant: str | None) -> tuple[Path, str]:
    if tenant is not None and not config.tenants.adapter_per_tenant:
        raise Refused("--tenant needs tenants.adapter_per_tenant: otherwise every tenant shares one policy")
    return Path(config.data_dir) / "adapters", adapter_name(tenant)


def _refusing(fn: Any) -> Any:
    def run(args: argparse.Namespace, config: Config) -> int:
        try:
            return fn(args, config)
        except Refused as exc:
            console.print(f"[red]refused:[/red] {exc}")
            return 2
    return run


def cmd_versions(args: argparse.Namespace, config: Config) -> int:
    root, name = _where(config, args.tenant)
    rows = store.describe(root, name)
    if args.json:
        print(json.dumps({"adapter": name, "control": store.control(root, name), "versions": rows}))
        return 0
    table = Table(title=f"{name}: versions on disk (probe scores of each candidate; the base is v0)")
    for column in ("version", "status", "sane", "relevance", "fluency", "KL", "entropy"):
        table.add_column(column, justify="left" if column == "status" else "right")
    for row in rows:
        cells = [f"{row[k]:.2f}" if isinstance(row[k], float) else "-" for k in ("sane_rate", "relevance", "fluency",
                                                                                  "kl", "entropy")]
        status = row["status"] + (" (pinned)" if row["pinned"] else "")
        style = {"promoted": "green", "rejected": "red"}.get(row["status"])
        table.add_row(f"v{row['version']}", status, *cells, style=style)
    console.print(table)
    # The reasons below the table, whole: a squeezed column would cut the one thing a reader needs.
    for row in rows:
        if row["reason"]:
            console.print(f"v{row['version']} {row['status']}: {row['reason']}", soft_wrap=True)
    return 0


def cmd_rollback(args: argparse.Namespace, config: Config) -> int:
    root, name = _where(config, args.tenant)
    if args.version != 0 and args.version not in store.published(root, name):
        raise Refused(f"{name} v{args.version} is not on disk (see `clawr1 versions`)")
    store.set_control(root, name, rollback={"to": args.version, "id": uuid.uuid4().hex})
    console.print(f"{name}: rolling back to v{args.version} (the gateway serves it and the trainer trains on "
                  "from it within a poll)")
    return 0


def cmd_pin(args: argparse.Namespace, config: Config) -> int:
    root, name = _where(config, args.tenant)
    if args.off == (args.version is not None):
        raise Refused("give a version to pin, or --off")
    if args.version is not None and args.version != 0 and args.version not in store.published(root, name):
        raise Refused(f"{name} v{args.version} is not on disk (see `clawr1 versions`)")
    store.set_control(root, name, pinned=None if args.off else args.version)
    console.print(f"{name}: " + ("unpinned: the newest promoted version is served" if args.off else
                                 f"pinned to v{args.version}: it is served until `clawr1 pin --off`"))
    return 0
