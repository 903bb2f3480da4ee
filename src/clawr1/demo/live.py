"""What the demo shows while the users talk: the preference score per served version, and beside
it the sane rate of the replies that version served.

The users talk with plain requests, exactly as before; the quality of what they were served is
measured afterwards, in batches, through `POST /v1/quality` against the base replies of the
"before" evaluation (the base model's replies to the held-out prompts: its normal range). A
version whose preference score climbs while its sane rate falls is winning by nonsense, and the
table shows it the moment it happens.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

from rich.table import Table

from clawr1.demo.evaluate import quality, sampled
from clawr1.demo.users import SimulatedUser


def version_of(fingerprint: str | None) -> int:
    return int(fingerprint.rsplit("-v", 1)[1]) if fingerprint and "-v" in fingerprint else -1


class Scoreboard:
    """Preference score per served version, from the users' own replies, and the sane rate of the
    replies measured so far."""

    def __init__(self) -> None:
        self.kept: dict[int, list[bool]] = collections.defaultdict(list)
        self.sane: dict[int, list[bool]] = collections.defaultdict(list)
        self.unmeasured: list[tuple[int, str]] = []  # (version, completion id) not yet measured
        self.replies = 0

    def add(self, version: int, kept: bool, completion_id: str | None = None) -> None:
        self.kept[version].append(kept)
        self.replies += 1
        if completion_id is not None:
            self.unmeasured.append((version, completion_id))

    def add_quality(self, version: int, sane: bool) -> None:
        self.sane[version].append(sane)

    def per_version(self) -> list[dict[str, Any]]:
        return [{"version": v, "replies": len(k), "score": sum(k) / len(k), "measured": len(self.sane.get(v, [])),
                 "sane_rate": sum(self.sane[v]) / len(self.sane[v]) if self.sane.get(v) else None}
                for v, k in sorted(self.kept.items())]

    def latest(self) -> int:
        return max(self.kept, default=0)


class QualityTracker:
    """Measures the users' replies in batches of `batch` against `reference_ids` (the base replies)."""

    def __init__(self, client: Any, board: Scoreboard, reference_ids: list[str], batch: int):
        self.client, self.board, self.reference_ids, self.batch = client, board, reference_ids, batch

    async def run(self, done: asyncio.Event, poll_s: float = 2.0) -> None:
        """Measure full batches until `done`; the rest is the caller's `flush` once every user has
        stopped (replies still in flight when `done` is set arrive after it)."""
        while not done.is_set():
            if len(self.board.unmeasured) >= self.batch:
                await self.measure_some()
            else:
                await asyncio.sleep(poll_s)

    async def flush(self) -> None:
        while self.board.unmeasured:
            await self.measure_some()

    async def measure_some(self) -> None:
        chunk, self.board.unmeasured = self.board.unmeasured[: self.batch], self.board.unmeasured[self.batch:]
        answer = await quality(self.client, [cid for _, cid in chunk], self.reference_ids)
        for (version, _), row in zip(chunk, answer["data"]):
            self.board.add_quality(version, row["sane"])


async def talk(user: SimulatedUser, client: Any, board: Scoreboard, turns: int, max_tokens: int,
               temperature: float | None, done: asyncio.Event, named: bool = False) -> None:
    """One user's conversations, back to back, until `done`. Plain OpenAI requests, no headers
    (`named`: one, `X-User-Id`, the user's name, so the memory knows whose turn it is)."""
    headers = {"X-User-Id": user.name} if named else {}
    while not done.is_set():
        messages = [{"role": "system", "content": user.system}, {"role": "user", "content": user.first_message()}]
        for _ in range(turns):
            response = await client.chat.completions.create(model="clawr1", messages=messages, max_tokens=max_tokens,
                                                            extra_headers=headers, **sampled(temperature))
            choice = response.choices[0]
            text = choice.message.content or ""
            kept, said = user.react(text, choice.finish_reason == "stop")
            board.add(version_of(response.system_fingerprint), kept, response.id)
            if done.is_set():
                return
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": said}]


def live_table(board: Scoreboard, metrics: list[dict[str, Any]], method: str, started: float,
               curve: list[dict[str, Any]]) -> Table:
    """Per version: the users' preference score, the sane rate of what it served, the trainer's
    numbers, and the held-out evaluation when one ran on that version."""
    by_version = {m["version"]: m for m in metrics}
    held_out = {c["version"]: c for c in curve}
    table = Table(title=f"clawr1 demo ({method}): preference score and sane rate per policy version "
                        f"[{time.monotonic() - started:.0f} s, {board.replies} replies]")
    for col in ("version", "replies", "score", "", "sane", "held-out pref+sane", "trained on", "reward", "hints",
                "loss"):
        table.add_column(col, justify="right" if col else "left")
    for row in board.per_version()[-18:]:
        m, h = by_version.get(row["version"], {}), held_out.get(row["version"])
        sane = "-" if row["sane_rate"] is None else f"{row['sane_rate']:.2f} ({row['measured']})"
        shown = "" if h is None or h.get("preferred_and_sane") is None else f"{h['preferred_and_sane']:.2f}"
        table.add_row(f"v{row['version']}", str(row["replies"]), f"{row['score']:.2f}", "#" * round(row["score"] * 20),
                      sane, shown, str(m.get("lease", "")), f"{m['reward_mean']:+.2f}" if m else "",
                      f"{m['hint_rate']:.0%}" if m else "", f"{m['loss']:+.3f}" if m else "")
    return table
