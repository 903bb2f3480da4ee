"""`RayPool`: the `DataPool` contract over the pool service actor (`actors.PoolService`), for the
gateway, the judges and the trainer of a Ray deployment.

The gateway calls the pool inside its async request handlers, so the two calls on its request path
never wait for the actor: a write (`submit_step`, `submit_reward`) returns a future at once, which
resolves once the service has committed it, as with a local pool; and `pending_writes` counts this
client's writes still in flight, with no round trip. Every other method is one blocking actor call
(`ray.get`): callers on an event loop run them in a thread (`asyncio.to_thread`).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from clawr1.core.records import Hint, Reward, Step
from clawr1.datapool.base import DataPool, PoolQueue, PoolReadModel


class _RayPoolBase(DataPool):
    def __init__(self, actor: Any):
        self.actor = actor
        self._in_flight = 0  # writes submitted and not yet answered (see `pending_writes`)
        self._lock = threading.Lock()  # futures resolve on Ray's threads
        self._write_error: str | None = None  # why the service's last step write failed (`write_error`)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        import ray

        return ray.get(self.actor.call.remote(method, args, kwargs))

    def _track(self, ref: Any) -> Future:
        """The write's future (it resolves when the service answers), counted until then."""
        with self._lock:
            self._in_flight += 1
        future = ref.future()
        future.add_done_callback(self._answered)
        return future

    def _answered(self, _: Future) -> None:
        with self._lock:
            self._in_flight -= 1

    def submit_step(self, step: Step) -> Future[bool]:
        if not isinstance(step, Step):
            raise TypeError(f"expected a Step, got {type(step).__name__}")
        future = self._track(self.actor.append_step.remote(step))
        future.add_done_callback(self._step_answered)
        return future

    def _step_answered(self, future: Future) -> None:
        """A step append is always a valid write: its failure is the service's pool failing (a
        full disk, an I/O error, the actor gone), its success proves the pool writes again."""
        error = None if future.cancelled() else future.exception()
        self._write_error = None if error is None else f"{type(error).__name__}: {error}"

    def write_error(self) -> str | None:
        """As a local pool's, with no round trip: learned from this client's own step appends
        (the gateway then refuses requests, 503, instead of answering ones whose steps are lost)."""
        return self._write_error

    def check_writable(self) -> str | None:
        error = self._call("check_writable")
        if error is None:
            self._write_error = None
        return error

    def submit_reward(self, reward: Reward) -> Future[None]:
        if not isinstance(reward, Reward):
            raise TypeError(f"expected a Reward, got {type(reward).__name__}")
        return self._track(self.actor.call.remote("add_reward", (reward,), {}))

    def submit_judgement(self, reward: Reward, hint: Hint | None) -> Future[None]:
        if not isinstance(reward, Reward):
            raise TypeError(f"expected a Reward, got {type(reward).__name__}")
        return self._track(self.actor.call.remote("add_judgement", (reward, hint), {}))

    def pending_writes(self) -> int:
        """This client's writes not yet answered by the service: those queued in it for this gateway
        and those on their way (other clients' writes are theirs to count). Local: no round trip."""
        return self._in_flight

    def close(self) -> None:
        """The service outlives its clients: closing a client closes nothing."""


def _forward(name: str) -> Any:
    def method(self: _RayPoolBase, *args: Any, **kwargs: Any) -> Any:
        return self._call(name, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = getattr(DataPool, name).__doc__
    return method


# Every other method of the two contracts goes to the service as it is: the queue's (the gateway,
# the judges, the trainer) and the read model's (the dashboard, the CLI).
_FORWARDED = tuple(sorted((PoolQueue.__abstractmethods__ | PoolReadModel.__abstractmethods__)
                          - set(vars(_RayPoolBase))))
RayPool = type("RayPool", (_RayPoolBase,), {name: _forward(name) for name in _FORWARDED})
RayPool.__doc__ = "`DataPool` over the pool service actor."
