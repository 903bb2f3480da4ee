"""The demo's summary: the held-out headline (preferred and sane, before and after) beside the
preference score and the sane rate, and a few held-out replies verbatim, so a reader sees what the
numbers were made of."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

SAMPLES = 3


def rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def summary(result: dict[str, Any], console: Console) -> None:
    preferences = ", ".join(result["settings"]["preferences"])
    table = Table(title=f"demo summary ({result['method']}, preferences {preferences})")
    table.add_column("")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    before, after = result["before"], result["after"]
    if before and after:
        n = f" ({after['n']} held-out replies)"
        table.add_row("[bold]held-out preferred and sane[/bold]" + n, rate(before["preferred_and_sane"]),
                      rate(after["preferred_and_sane"]))
        if "substantive" in after:  # runs from before this measure have no such numbers
            table.add_row("  ... and substantive (adds to the question)", rate(before["preferred_sane_substantive"]),
                          rate(after["preferred_sane_substantive"]))
        table.add_row("held-out preference score", rate(before["score"]), rate(after["score"]))
        table.add_row("held-out sane rate", rate(before["sane_rate"]), rate(after["sane_rate"]))
        table.add_row("held-out replies that answer the question", rate(before["answered"]), rate(after["answered"]))
        if "substantive" in after:
            table.add_row("  ... and substantive", rate(before["substantive"]),
                          rate(after["substantive"]))
        table.add_row("mean relevance / fluency", f"{rate(before['relevance'])} / {rate(before['fluency'])}",
                      f"{rate(after['relevance'])} / {rate(after['fluency'])}")
        table.add_row("KL from the base (nats/token)", rate(before["kl"]), rate(after["kl"]))
        table.add_row("mean words per reply", f"{before['mean_words']:.0f}", f"{after['mean_words']:.0f}")
        for key in ("before", "after"):
            if result[key]["quality_error"]:
                table.add_row(f"quality ({key})", result[key]["quality_error"], "")
    rows = result["per_version"]
    if rows:
        table.add_row("live preference score, first / last version", rate(rows[0]["score"]), rate(rows[-1]["score"]))
        table.add_row("live sane rate, first / last version", rate(rows[0]["sane_rate"]), rate(rows[-1]["sane_rate"]))
    table.add_row("optimizer steps (versions served)", "", str(result["reached_version"]))
    table.add_row("user replies", "", str(result["replies"]))
    table.add_row("wall time", "", f"{result['wall_s']:.0f} s")
    console.print(table)
    if before and after:
        console.print(samples(before["replies"], after["replies"]))


def samples(before: list[dict[str, Any]], after: list[dict[str, Any]], n: int = SAMPLES) -> Table:
    """The first held-out reply of up to `n` preferences, before and after, verbatim."""
    table = Table(title="held-out replies, before -> after", show_lines=True)
    for col in ("question (preference)", "before", "after"):
        table.add_column(col, overflow="fold")
    seen: set[str] = set()
    for old, new in zip(before, after):
        if old["preference"] in seen or len(seen) >= n:
            continue
        seen.add(old["preference"])
        table.add_row(Text(f"{old['question']} ({old['preference']}, {old['user']})"), describe(old), describe(new))
    return table


def describe(reply: dict[str, Any]) -> Text:
    """A reply's text with its flags: preferred, sane (and why not), answered. Plain text: a reply
    is the model's, never markup."""
    flags = ["preferred" if reply["preferred"] else "not preferred"]
    if reply["sane"] is not None:
        flags.append("sane" if reply["sane"] else "NOT sane: " + "; ".join(reply["reasons"]))
    if reply["non_answer"]:
        flags.append(f"user: {reply['non_answer']}")
    elif reply.get("substantive") is False:
        flags.append("says nothing the question did not")
    text = reply["text"] if len(reply["text"]) <= 300 else reply["text"][:297] + "..."
    return Text(f"{text!r}\n[{', '.join(flags)}; {reply['version']}]")
