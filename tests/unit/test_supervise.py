"""The one supervisor: a part that stops is started again, saying why, until it ends for good (or,
for a process that must never end, until the server stops it)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from clawr1.entrypoints.supervise import keep_running
from tests.conftest import run


def test_a_failing_part_is_started_again_until_it_returns(caplog):
    calls = []

    async def part() -> None:
        calls.append(len(calls))
        if len(calls) < 3:
            raise RuntimeError(f"crash {len(calls)}")

    with caplog.at_level(logging.ERROR):
        run(keep_running("the part", part, delay_s=0))
    assert calls == [0, 1, 2]
    assert [r.getMessage() for r in caplog.records] == [
        "the part stopped (RuntimeError: crash 1); starting it again",
        "the part stopped (RuntimeError: crash 2); starting it again"]


def test_a_part_that_must_never_end_is_started_again_until_cancelled():
    calls = []

    async def part() -> None:
        calls.append(1)
        await asyncio.sleep(0)

    async def main() -> None:
        task = asyncio.create_task(keep_running("the trainer", part, again_on_return=True, delay_s=0))
        while len(calls) < 5:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    assert len(calls) >= 5


def test_the_trainers_outer_loop_reports_each_version_and_stops_when_told():
    """`train_until`, the loop `clawr1 train`, the Ray trainer actors and `Trainer.run` share: a
    version is reported, an idle round waits `poll_s`, setting the event ends it, and each round
    is handed the event."""
    import threading

    from clawr1.trainer.loop import train_until

    stop, seen, waits = threading.Event(), [], []
    made = iter([{"version": 1}, None, {"version": 2}])

    class Trainer:
        def run_once(self, given):  # the stop event reaches the trainer (a verdict wait ends on it)
            assert isinstance(given, Stop)
            version = next(made, None)
            if version is None and len(waits) >= 1 and seen == [1, 2]:
                stop.set()
            return version

    class Stop:
        def is_set(self):
            return stop.is_set()

        def wait(self, seconds):
            waits.append(seconds)

    train_until(Trainer(), Stop(), poll_s=0.25, on_version=lambda m: seen.append(m["version"]))
    assert seen == [1, 2] and waits and set(waits) == {0.25}
