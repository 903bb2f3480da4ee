"""The dashboard's HTML, rendered on the server from `data.summary` / `data.session`.

Everything that came from a client or a model is escaped: a conversation is untrusted text, and
the page is served under a CSP that allows only this package's own script and stylesheet.
"""

from __future__ import annotations

import json
import time
from html import escape
from typing import Any
from urllib.parse import quote

from clawr1.core import memory as rules
from clawr1.gateway.dashboard.charts import Series, line_chart

PANELS = ("overview", "curves", "versions", "queue", "sessions", "memory")
REFRESH_S = 5


def _t(ts: float | None) -> str:
    """A UTC wall-clock time, with the date only when it is not today."""
    if ts is None:
        return "-"
    same_day = time.strftime("%Y-%m-%d", time.gmtime(ts)) == time.strftime("%Y-%m-%d", time.gmtime())
    return time.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M", time.gmtime(ts))


def _n(value: Any, spec: str = ".3g", suffix: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:{spec}}{suffix}" if isinstance(value, (int, float)) else escape(str(value))


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _table(headers: list[str], rows: list[list[str]], empty: str, css: str = "") -> str:
    if not rows:
        return f'<p class="empty">{escape(empty)}</p>'
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _cards(items: list[tuple[str, str]]) -> str:
    return '<div class="cards">' + "".join(
        f'<div class="card"><div class="value">{value}</div><div class="label">{escape(label)}</div></div>'
        for label, value in items) + "</div>"


def _reward(value: float | None) -> str:
    if value is None:
        return '<span class="muted">-</span>'
    css = "pos" if value > 0 else "neg" if value < 0 else "zero"
    return f'<span class="{css}">{value:+.2f}</span>'


def _session_link(tenant: str, session_id: str) -> str:
    return (f'<a href="/dashboard/sessions/{quote(session_id, safe="")}?tenant={quote(tenant, safe="")}">'
            f'{escape(session_id)}</a>')


def overview(s: dict[str, Any]) -> str:
    pool, gw, judge = s["pool"], s["gateway"], s["judge"]
    last = gw["swaps"][-1] if gw["swaps"] else None
    cards = _cards([
        ("policy version served", f"v{s['served_version']}"),
        ("sessions (open)", f"{pool['sessions']} ({pool['open_sessions']})"),
        ("steps recorded", str(pool["steps"])),
        ("pool size", _bytes(pool["db_bytes"])),
        ("rewards / hints", f"{pool['rewards']} / {pool['hints']}"),
        ("READY for the trainer", str(pool["ready"])),
        ("in flight / writes queued", f"{gw['inflight']} / {gw['pending_writes']}"),
        ("swaps (last load)", f"{len(gw['swaps'])}" + (f" ({last['load_s'] * 1000:.0f} ms)" if last else "")),
    ])
    decided = [r["probe_status"] for r in s["versions"] if r["probe_status"]]
    if s.get("guard") is not None:
        last = next((r for r in reversed(s["versions"]) if r["probe_status"]), None)
        said = (f'; last: v{last["version"]} {escape(last["probe_status"])} ({escape(last["probe_reason"])})'
                if last else "")
        pinned = (s.get("control") or {}).get("pinned")
        in_a_row = s.get("rejected_in_a_row") or 0
        cards += (f'<p class="note">guard: {decided.count("promoted")} promoted, {decided.count("rejected")} rejected'
                  f'{said}{f"; pinned to v{pinned}" if pinned is not None else ""}'
                  + (f'; <b>{in_a_row} rejected in a row</b>' if in_a_row >= 3 else "") + '</p>')
    how = gw["turns_by_how"]
    if how:
        cards += ('<p class="note">sessions found by: ' + ", ".join(f"{escape(k)} {n}" for k, n in how.items())
                  + (f'; <b>{how["unmatched"]} turns carried history no open session held</b> (a conversation '
                     'split in two: see docs/gateway.md, Sessions)' if how.get("unmatched") else "") + "</p>")
    if judge["running"]:
        outcomes = ", ".join(f"{escape(k)}: {n}" for k, n in judge["outcomes"].items()) or "nothing judged yet"
        cards += (f'<p class="note">judge: {outcomes}; hints accepted {judge["hints"]}; '
                  f'errors {judge["errors"]}; turns given up on {judge["gave_up"]}</p>')
    else:
        cards += '<p class="note">no judge in this process (`clawr1 serve`): rewards come from feedback and closes</p>'
    return cards


def curves(s: dict[str, Any]) -> str:
    rows = s["versions"]

    def points(key: str, scale: float = 1.0) -> list[tuple[float, float]]:
        return [(r["version"], r[key] * scale) for r in rows if r[key] is not None]

    reward = line_chart("Reward by policy version", [
        Series("served turns", points("mean_reward"), "s1"),
        Series("trainer batch", points("reward_mean"), "s2"),
    ], x_label="policy version", y_range=(-1.0, 1.0))
    # Every learning number beside its quality number: a score won by nonsense shows as a falling
    # sane rate on the same chart (the guard's probe replies of each candidate, rejected ones too).
    preference = line_chart("Preference score and quality by policy version", [
        Series("approved / judged", points("preference_score"), "s3"),
        Series("sane probe replies", points("probe_sane_rate"), "s1"),
    ], x_label="policy version", y_range=(0.0, 1.0))
    drift = line_chart("Drift from the base model", [
        Series("probe KL (nats/token)", points("probe_kl"), "s4"),
        Series("trainer KL to base", points("kl_base"), "s2"),
        Series("trainer entropy", points("entropy"), "s3"),
    ], x_label="policy version")
    latency = line_chart("Feedback-to-serving latency", [
        Series("median", points("latency_s"), "s4"),
        Series("to publish", points("publish_s"), "s2"),
    ], x_label="policy version", y_unit=" s")
    return f'<div class="charts">{reward}{preference}{drift}{latency}</div>'


def versions(s: dict[str, Any]) -> str:
    limit = (s.get("guard") or {}).get("max_kl")
    pinned = (s.get("control") or {}).get("pinned")
    rows = []
    for r in reversed(s["versions"]):
        status = r["probe_status"] or ("base" if r["version"] == 0 else "")
        runaway = limit is not None and r["probe_kl"] is not None and r["probe_kl"] > limit
        rows.append([f"v{r['version']}" + (" (pinned)" if pinned == r["version"] else ""),
                     (f'<span class="verdict {escape(status)}" title="{escape(r["probe_reason"] or "")}">'
                      f"{escape(status)}</span>"),
                     _n(r["probe_sane_rate"], ".2f"), _n(r["probe_relevance"], ".2f"), _n(r["probe_fluency"], ".2f"),
                     f'<span class="{"runaway" if runaway else ""}">{_n(r["probe_kl"], ".3g")}</span>',
                     _n(r["entropy"], ".3g"), _t(r["published_at"]), _n(r["trained_on"]),
                     f'<span class="{"runaway" if r["no_signal"] else ""}">{_n(r["no_signal"])}</span>'
                     + (' <span class="runaway">KL off</span>' if r["kl_silent"] else ""), _lost(r["lost"]),
                     _n(r["loss"], "+.4f"),
                     _reward(r["reward_mean"]), _n(r["hint_rate"], ".0%"), _n(r["clip_frac"], ".2f"),
                     str(r["turns"]), _reward(r["mean_reward"]), _n(r["preference_score"], ".2f"),
                     _n(r["latency_s"], ".1f", " s"), _t(r["first_served_at"]), _actions(s, r["version"])])
    return _table(["version", "guard", "probe sane", "relevance", "fluency", "probe KL", "entropy", "published",
                   "trained on", "no signal", "lost", "loss", "batch reward", "hints", "clip", "turns served", "reward", "preference",
                   "feedback→serving", "first served", ""], rows, "no versions yet", "numbers")


def _lost(lost: dict[str, float] | None) -> str:
    """Turns that left training unused before this version: the total, and why on hover."""
    if lost is None:
        return "-"
    why = ", ".join(f"{key} {n:.0f}" for key, n in sorted(lost.items()))
    total = sum(lost.values())
    return f'<span class="{"runaway" if total else ""}" title="{escape(why)}">{total:.0f}</span>'


def _actions(s: dict[str, Any], version: int) -> str:
    """The admin's levers (`clawr1 pin N`, `clawr1 rollback N`) as two small forms per version."""
    tenant = f'<input type="hidden" name="tenant" value="{escape(s["tenant"] or "")}">'
    forms = []
    for action, label in (("pin", "pin"), ("rollback", "roll back")):
        forms.append(f'<form method="post" action="/dashboard/versions" class="inline">{tenant}'
                     f'<input type="hidden" name="action" value="{action}">'
                     f'<input type="hidden" name="version" value="{version}"><button>{label}</button></form>')
    return "".join(forms)


def queue(s: dict[str, Any]) -> str:
    pool = s["pool"]
    counts = _cards([(status, str(pool[status])) for status in ("pending", "ready", "leased", "consumed", "dropped")])
    drops = ", ".join(f"{escape(str(k))}: {n}" for k, n in sorted(pool["dropped_by_reason"].items()))
    counts += f'<p class="note">dropped by reason: {drops or "none"}; open leases: {pool["open_leases"]}</p>'
    rows = [[_session_link(r["tenant"], r["session_id"]), str(r["turn_index"]), f"v{r['policy_version']}",
             f'<span class="status {escape(r["status"])}">{escape(r["status"])}</span>', _reward(r["reward"]),
             _n(r["weight"], ".2g"), escape(r["reason"] or ""), _t(r["updated_at"])] for r in s["samples"]]
    return counts + _table(["session", "turn", "version", "status", "reward", "weight", "reason", "updated"], rows,
                           "no samples yet: main turns appear here")


def sessions(s: dict[str, Any]) -> str:
    rows = [[_session_link(r["tenant"], r["session_id"]), escape(r["tenant"]),
             f'<span class="status {escape(r["status"])}">{escape(r["status"])}</span>', str(r["steps"]),
             _reward(r["outcome_reward"]), _t(r["created_at"]), _t(r["updated_at"])] for r in s["sessions"]]
    return _table(["session", "tenant", "status", "turns", "outcome", "started", "last active"], rows,
                  "no sessions yet: point an agent at /v1")


def memory(s: dict[str, Any]) -> str:
    """The per-user memory: each entry with where it came from (the session, the corrected step, the
    user's correction), when it was added, its status, and the admin's levers (`clawr1 memory forget`,
    `clawr1 memory off`) as small forms."""
    m = s["memory"]
    off = [f"tenant {escape(t)} (config)" for t in m["off_tenants"]] + [
        (f"user {escape(o['user_id'])} of " if o["user_id"] else "") + f"tenant {escape(o['tenant'])}" for o in m["off"]]
    note = ('<p class="note">' + ("memory is on" if m["enabled"] else "<b>memory is off</b> (memory.enabled)")
            + f"; a request with no user id is the user of {escape(m['fallback'])}"
            + (f"; off for {', '.join(off)}" if off else "") + "</p>")
    rows = []
    for e in m["entries"]:
        status = escape(e["status"])
        why = escape(e["reason"] or (f"replaced by {e['replaced_by']}" if e["replaced_by"] else ""))
        if str(e["id"]) in m["unsafe"]:
            why = escape(f"never added: holds {m['unsafe'][str(e['id'])]!r}, a token of the served model")
        origin = (f'{_session_link(e["tenant"], e["session_id"])} · <span class="muted">{escape(e["step_id"])} '
                  f'({escape(e["source"])})</span>')
        rows.append([str(e["id"]), escape(e["user_id"]), f'<span class="status {status}">{status}</span>'
                     + (f' <span class="muted">{why}</span>' if why else ""), escape(e["text"]), origin,
                     f'<span class="muted">{escape(e["correction"] or "")}</span>', _t(e["created_at"]),
                     escape(rules.learned(e.get("checks") or [])), _memory_actions(e)])
    return note + _table(["id", "user", "status", "entry", "from", "correction", "added",
                          "left to learn (nats a token, per version)", ""], rows,
                         "no memory entries yet: a correction of a user's turn (X-User-Id) makes one")


def _memory_actions(e: dict[str, Any]) -> str:
    """Forget this entry; turn the memory off for its user."""
    tenant = f'<input type="hidden" name="tenant" value="{escape(e["tenant"])}">'
    forms = []
    if e["status"] != "forgotten":
        forms.append(f'<form method="post" action="/dashboard/memory" class="inline">{tenant}'
                     f'<input type="hidden" name="action" value="forget"><input type="hidden" name="id" '
                     f'value="{e["id"]}"><button>forget</button></form>')
    forms.append(f'<form method="post" action="/dashboard/memory" class="inline">{tenant}'
                 f'<input type="hidden" name="action" value="off"><input type="hidden" name="user" '
                 f'value="{escape(e["user_id"])}"><button>off for this user</button></form>')
    return "".join(forms)


RENDER = {"overview": overview, "curves": curves, "versions": versions, "queue": queue, "sessions": sessions,
          "memory": memory}
TITLES = {"overview": "Now", "curves": "Learning", "versions": "Policy versions",
          "queue": "Sample queue", "sessions": "Sessions", "memory": "Memory"}


def panels(s: dict[str, Any]) -> dict[str, str]:
    return {name: RENDER[name](s) for name in PANELS}


def _page(title: str, body: str, note: str) -> str:
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            '<link rel="icon" href="data:,"><link rel="stylesheet" href="/dashboard/static/dashboard.css"></head><body>'
            f'<header><h1><a href="/dashboard">Claw-R1</a></h1><span class="note">{escape(note)}</span>'
            '<span id="live" class="note"></span></header>'
            f'<main>{body}</main><script src="/dashboard/static/dashboard.js"></script></body></html>')


def _tenant_picker(s: dict[str, Any]) -> str:
    """Links to each tenant's own dashboard (shown when tenants are configured)."""
    if len(s["tenants"]) < 2:
        return ""
    links = [f'<a href="/dashboard"{" class=current" if s["tenant"] is None else ""}>all tenants</a>']
    links += [f'<a href="/dashboard?tenant={quote(t, safe="")}"{" class=current" if s["tenant"] == t else ""}>'
              f'{escape(t)}</a>' for t in s["tenants"]]
    return f'<nav class="tenants">tenant: {" · ".join(links)} · versions of <code>{escape(s["adapter"])}</code></nav>'


def main_page(s: dict[str, Any], note: str) -> str:
    rendered = panels(s)
    body = _tenant_picker(s) + "".join(
        f'<section><h2>{TITLES[name]}</h2><div data-panel="{name}">{rendered[name]}</div></section>' for name in PANELS)
    return _page("Claw-R1 dashboard", body, f"{s['model']} · {note}").replace(
        "<main>", f'<main data-refresh="{REFRESH_S}">', 1)


def _content(value: Any) -> str:
    """Message content as text: a string, or the text of OpenAI content parts."""
    if isinstance(value, list):
        return "".join(p.get("text", "") for p in value if isinstance(p, dict))
    return "" if value is None else str(value)


def _messages(messages: list[dict[str, Any]] | None) -> str:
    if not messages:
        return '<span class="muted">not yet (the next turn has not arrived)</span>'
    out = []
    for m in messages:
        text = _content(m.get("content"))
        if m.get("tool_calls"):
            text += " " + json.dumps(m["tool_calls"], ensure_ascii=False)
        out.append(f'<div class="msg"><b>{escape(str(m.get("role")))}</b> {escape(text)}</div>')
    return "".join(out)


def _evidence(raw: str) -> str:
    """A reward's evidence: the judge stores JSON (its reason first, then raw outputs); show the
    reason plainly and the rest muted. Anything else is shown as it is."""
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        return escape(raw)
    reason = data.pop("evidence", "")
    rest = "; ".join(f"{k}: {json.dumps(v, ensure_ascii=False)}" for k, v in data.items() if v not in (None, [], ""))
    return escape(str(reason)) + (f' <span class="muted">({escape(rest)})</span>' if rest else "")


def _judging(t: dict[str, Any]) -> str:
    """A turn's failed judging attempts: the give-up with its reason, or the retries so far."""
    attempts = t.get("judge_attempts") or 0
    if not attempts:
        return ""
    error = escape(t.get("judge_error") or "")
    if t.get("judge_gave_up_at") is not None:
        return (f'<p class="neg">judge gave up after {attempts} failed attempt{"s" * (attempts != 1)} '
                f'({_t(t["judge_gave_up_at"])}): {error}</p>')
    return f'<p class="note">judging failed {attempts} time{"s" * (attempts != 1)}, retrying; last error: {error}</p>'


def session_page(s: dict[str, Any], note: str) -> str:
    turns = []
    for t in s["steps"]:
        rewards = "".join(
            f'<li>{_reward(r["score"])} <b>{escape(r["source"])}</b> votes {escape(json.dumps(r["votes"]))}'
            f'{" · " + _evidence(r["evidence"]) if r["evidence"] else ""}</li>' for r in t["rewards"])
        hints = "".join(f'<li><b>{escape(h["source"])}</b> {escape(h["text"])}</li>' for h in t["hints"])
        status = escape(t["status"] or "side turn")
        carried = (t.get("memory") or {}).get("entries") or []
        memory = ('<p class="note">memory in its prompt (' + escape(t["memory"]["user"]) + "): " + "; ".join(
            f'#{e["id"]} {escape(e["text"])}' for e in carried) + "</p>") if carried else ""
        turns.append(
            f'<article class="turn"><h3>turn {t["turn_index"]} · {escape(t["turn_type"])} · v{t["policy_version"]} '
            f'· {escape(t["finish_reason"])} · <span class="status {status}">{status}</span>'
            f'{" (" + escape(t["reason"]) + ")" if t["reason"] else ""} · reward {_reward(t["reward"])}</h3>'
            f'<div class="grid3"><div><h4>asked</h4><div class="msg">{escape(_content(t["context"]))}</div></div>'
            f'<div><h4>reply</h4><div class="msg">{escape(t["text"])}</div></div>'
            f'<div><h4>next state</h4>{_messages(t["next_state"])}</div></div>{memory}'
            f'<h4>rewards</h4><ul>{rewards or "<li class=muted>none yet</li>"}</ul>{_judging(t)}'
            f'{"<h4>hints</h4><ul>" + hints + "</ul>" if hints else ""}</article>')
    events = _table(["event", "data", "at"], [[escape(e["kind"]), escape(json.dumps(e["data"])), _t(e["created_at"])]
                                              for e in s["events"]], "no events")
    head = (f'<section><h2>Session {escape(s["session_id"])}</h2><p class="note">tenant {escape(s["tenant"])} · '
            f'{escape(s["status"])} · outcome {_reward(s["outcome_reward"])} · started {_t(s["created_at"])} · '
            f'last active {_t(s["updated_at"])}</p></section>')
    body = head + f'<section><h2>Turns</h2>{"".join(turns) or "<p class=empty>no turns</p>"}</section>'
    return _page(f"Claw-R1 session {s['session_id']}", body + f"<section><h2>Events</h2>{events}</section>", note)


def login_page(message: str | None = None) -> str:
    error = f'<p class="neg">{escape(message)}</p>' if message else ""
    form = ('<section class="login"><h2>Sign in</h2><p class="note">The dashboard needs the gateway\'s admin key '
            '(<code>gateway.admin_key</code>).</p>' + error +
            '<form method="post" action="/dashboard/login"><input type="password" name="key" autocomplete="off" '
            'placeholder="admin key" autofocus required><button type="submit">Open the dashboard</button>'
            '</form></section>')
    return _page("Claw-R1 dashboard: sign in", form, "admin key required")


def disabled_page() -> str:
    body = ('<section><h2>Dashboard disabled</h2><p>This gateway has agent keys but no admin key. Set '
            '<code>gateway.admin_key</code> (16+ characters) to open the dashboard; agent keys never do.</p></section>')
    return _page("Claw-R1 dashboard", body, "admin key not configured")


def missing_page(message: str, heading: str = "Not found") -> str:
    return _page("Claw-R1 dashboard", f'<section><h2>{escape(heading)}</h2><p>{escape(message)}</p></section>', "")
