"""`clawr1 memory list|show|forget|off|on`: the per-user memory (`clawr1/core/memory.py`): each
entry with where it came from (the corrected turn's session and step, the user's correction), when
it was added and its status; and the admin's levers, to forget an entry (or all of a user's) and to
turn the memory off (or on again) for a user or a whole tenant.

The levers write to the pool, as `clawr1 pin` writes the version store: nothing needs to be running,
and a running gateway applies them at its next read of the pool (`memory.refresh_s`). The same
actions are on the dashboard's Memory panel for the admin.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clawr1.core.config import Config
from clawr1.core.memory import STATUSES, learned
from clawr1.core.records import DEFAULT_TENANT

console = Console()
err_console = Console(stderr=True)
KINDS = ("user:", "session:")


def add_arguments(sub: Any, common: Any) -> None:
    p = sub.add_parser("memory", help="per-user memory: list, show, forget entries; turn it off or on for a user "
                                      "or tenant")
    common(p)
    p.add_argument("action", choices=["list", "show", "forget", "off", "on"])
    p.add_argument("entry", nargs="?", type=int, help="an entry id (show, forget)")
    p.add_argument("--tenant", help=f"the tenant (list: default all; forget --user, off, on: default {DEFAULT_TENANT})")
    p.add_argument("--user", help="a user: the X-User-Id (or OpenAI `user`) it named, or a key as listed "
                                  "(user:ID, session:ID, tenant); off/on without it: the whole tenant")
    p.add_argument("--status", choices=STATUSES, help="list: only entries of this status")
    p.add_argument("--limit", type=int, default=100, help="list: newest N entries")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_memory)


def user_key(user: str | None) -> str | None:
    """`alice` -> `user:alice`; a key as the pool lists it (`user:...`, `session:...`, `tenant`) as it is."""
    if user is None:
        return None
    return user if user.startswith(KINDS) or user == "tenant" else f"user:{user}"


def cmd_memory(args: argparse.Namespace, config: Config) -> int:
    from clawr1.datapool import open_existing_pool

    user = user_key(args.user)
    if args.action in ("show", "forget") and args.entry is None and not (args.action == "forget" and user):
        err_console.print(f"[red]error:[/red] memory {args.action} needs an entry id"
                          + (" (or --user)" if args.action == "forget" else ""))
        return 2
    with open_existing_pool(config) as pool:
        if args.action == "list":
            entries = pool.memory(args.tenant, user, args.status, max(1, args.limit))
            switches = pool.memory_switches(args.tenant)
            if args.json:
                print(json.dumps({"entries": entries, "off": switches, "enabled": config.memory.enabled,
                                  "off_tenants": config.memory.off_tenants}))
            else:
                _table(entries, switches, config)
        elif args.action == "show":
            try:
                entry = pool.memory_entry(args.entry, args.tenant)
            except KeyError as exc:
                err_console.print(f"[red]error:[/red] {exc.args[0]}")
                return 1
            print(json.dumps(entry, indent=2, ensure_ascii=False))
        elif args.action == "forget":
            tenant = args.tenant if args.entry is not None else (args.tenant or DEFAULT_TENANT)
            ids = pool.forget_memory(args.entry, tenant=tenant, user=None if args.entry is not None else user)
            if args.entry is not None and not ids:
                err_console.print(f"[red]error:[/red] no memory entry {args.entry} to forget"
                                  + (f" in tenant {args.tenant}" if args.tenant else "") + " (or forgotten already)")
                return 1
            print(json.dumps({"forgotten": ids}) if args.json else
                  f"forgotten: {', '.join(map(str, ids)) or 'nothing'} (a running gateway drops them within "
                  f"{config.memory.refresh_s:g} s)")
        else:
            tenant, off = args.tenant or DEFAULT_TENANT, args.action == "off"
            changed = pool.switch_memory(tenant, user or "", off)
            who = f"user {user} of tenant {tenant}" if user else f"tenant {tenant}"
            print(json.dumps({"tenant": tenant, "user": user or "", "off": off, "changed": changed}) if args.json else
                  f"memory {'off' if off else 'on'} for {who}" + ("" if changed else " (it was already)"))
    return 0


def _table(entries: list[dict[str, Any]], switches: list[dict[str, Any]], config: Config) -> None:
    table = Table(title="memory entries, newest first")
    for column in ("id", "tenant", "user", "status", "entry", "from (session · step)", "correction", "added",
                   "left to learn"):
        table.add_column(column, overflow="fold")
    for e in entries:
        status = e["status"] + (f" by {e['replaced_by']}" if e["replaced_by"] else "") + (
            f": {e['reason']}" if e["reason"] else "")
        table.add_row(str(e["id"]), escape(e["tenant"]), escape(e["user_id"]), escape(status), escape(e["text"]),
                      escape(f"{e['session_id']} · {e['step_id']} ({e['source']})"), escape(e["correction"] or ""),
                      time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["created_at"])),
                      escape(learned(e.get("checks") or [], last=3)),
                      style={"active": "green", "refused": "red", "retired": "blue"}.get(e["status"]))
    console.print(table)
    if not config.memory.enabled:
        console.print("memory is off (memory.enabled = false)")
    for tenant in config.memory.off_tenants:
        console.print(f"memory off for tenant {tenant} (memory.off_tenants)")
    for s in switches:
        console.print(f"memory off for {'user ' + escape(s['user_id']) + ' of ' if s['user_id'] else ''}tenant "
                      f"{escape(s['tenant'])} (clawr1 memory off)")
