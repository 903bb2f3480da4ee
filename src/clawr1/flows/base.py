"""The white-box flow contract: an `AgentFlow` runs one task with an OpenAI-compatible client and
returns the outcome.

The client's base URL already carries `/{session_id}/{prompt_id}/v1`, so every call the flow
makes is recorded as the next turn of its own session, and the G rollouts of one task share a
prompt id (their GRPO group). The flow never talks to the pool or the trainer: it is an agent like
any other, which is why the same flow also runs against a remote gateway.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from clawr1.core.config import Config
from clawr1.envs.base import Task

if TYPE_CHECKING:
    import openai


class AgentFlow(ABC):
    """One agent program. `run` is called from several threads at once (one per rollout), so it
    keeps per-rollout state in locals, not on `self`."""

    #: Registry name (for the built-in flows).
    name: str = ""

    def __init__(self, config: Config | None = None):
        self.config = config or Config()

    @abstractmethod
    def run(self, task: Task, client: openai.OpenAI) -> float | None:
        """Solve `task` with `client` (every call is recorded into this rollout's session).

        Returns:
            The outcome in [-1, 1] (1 solved, -1 not), or None when the flow cannot tell; the
            session then closes without a reward and its last turn is masked.
        """
