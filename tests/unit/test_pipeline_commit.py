"""The pipeline's small helpers on the hot path: waiting for the pool's commit (`committed`) and
rendering a reply body (`json_body`), each against what it stands for."""

import asyncio
import concurrent.futures
import json
import math
import threading

import pytest

from clawr1.gateway.pipeline import committed, json_body
from tests.conftest import run


def resolve_later(future: concurrent.futures.Future, result: object = True, error: BaseException | None = None) -> None:
    """Resolve `future` from another thread, as the pool's writer does after its COMMIT."""
    def resolve() -> None:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    threading.Timer(0.01, resolve).start()


def test_committed_waits_for_every_future_resolved_in_another_thread():
    async def go():
        futures = [concurrent.futures.Future() for _ in range(3)]
        for future in futures:
            resolve_later(future)
        waiter = committed(futures)
        await asyncio.wait_for(waiter, 5)
        return all(f.done() for f in futures)

    assert run(go())


def test_committed_raises_the_first_error_and_takes_a_future_already_failed():
    async def go(already_failed: bool):
        ok, bad = concurrent.futures.Future(), concurrent.futures.Future()
        resolve_later(ok)
        if already_failed:  # refused at once (queue or disk full): failed before anyone waits
            bad.set_exception(OSError("disk full"))
        else:
            resolve_later(bad, error=OSError("disk full"))
        await asyncio.wait_for(committed([ok, bad]), 5)

    for already_failed in (False, True):
        with pytest.raises(OSError, match="disk full"):
            run(go(already_failed))


def test_a_waiter_cancelled_never_cancels_the_pools_future():
    """A request cancelled while it waits (shutdown, a hang-up): the writer must still resolve the
    step it was handed (what `asyncio.shield` around `wrap_future` was for)."""
    async def go():
        future = concurrent.futures.Future()
        task = asyncio.ensure_future(committed([future]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        future.set_result(True)  # the writer commits later: no error anywhere
        await asyncio.sleep(0.01)
        return future.cancelled(), future.result()

    assert run(go()) == (False, True)


@pytest.mark.parametrize("content", [
    {"id": "chatcmpl-1", "choices": [{"message": {"content": "héllo \"x\" \u2028 😀\n"}, "logprobs": None}]},
    {"n": [1, 2.5, -1e-05, 1e300, True, None], "nested": {"a": {"b": ["c"]}}},
    "plain text", [], {},
])
def test_json_body_is_what_json_dumps_writes(content):
    assert json_body(content) == json.dumps(content, ensure_ascii=False, allow_nan=False,
                                            separators=(",", ":")).encode()


def test_json_body_refuses_what_json_cannot_carry():
    for value in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError):
            json_body({"logprob": value})
