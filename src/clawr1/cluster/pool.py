"""`RayPool`: the `DataPool` contract over the pool service actor (`actors.PoolService`), for the
gateway, the judges and the trainer of a Ray deployment. Each call is one actor call; a step's
write returns a future that resolves once the service has committed it, as with a local pool."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from clawr1.core.records import Step
from clawr1.datapool.base import DataPool

# Every other method of the contract goes to the service as it is.
_FORWARDED = ("close_session", "open_session", "close_idle", "add_feedback", "add_hint", "mark_ready", "lease", "ack",
              "expire_leases", "get_steps", "last_turn", "session_by_key", "ready_state", "ready_tenants", "hints",
              "unjudged", "pending_writes", "stats", "sessions", "samples", "versions", "lease_ready_times", "show",
              "export")


class _RayPoolBase(DataPool):
    def __init__(self, actor: Any):
        self.actor = actor

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        import ray

        return ray.get(self.actor.call.remote(method, args, kwargs))

    def submit_step(self, step: Step) -> Future[bool]:
        if not isinstance(step, Step):
            raise TypeError(f"expected a Step, got {type(step).__name__}")
        return self.actor.append_step.remote(step).future()

    def submit_reward(self, reward: Any) -> Future[None]:
        return self.actor.call.remote("add_reward", (reward,), {}).future()

    def close(self) -> None:
        """The service outlives its clients: closing a client closes nothing."""


def _forward(name: str) -> Any:
    def method(self: _RayPoolBase, *args: Any, **kwargs: Any) -> Any:
        return self._call(name, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = getattr(DataPool, name).__doc__
    return method


RayPool = type("RayPool", (_RayPoolBase,), {name: _forward(name) for name in _FORWARDED})
RayPool.__doc__ = "`DataPool` over the pool service actor."
