"""`tool-agent`: the plain tool-calling loop, as most agents are written.

messages = [system, user]; ask the model with the env's tools; run every tool call it makes and
append the assistant message and the tool results; stop at a reply without tool calls (its text
is the final answer) or after `max_turns` model calls. Each model call is one main turn of the
session, and its tool results are that turn's next state, which the reward worker judges.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from clawr1.core.config import Config
from clawr1.envs.base import Task
from clawr1.envs.tools import call_mistake
from clawr1.flows.base import AgentFlow
from clawr1.flows.rollouts import EnvFactory, env_for

if TYPE_CHECKING:
    import openai


class ToolAgentFlow(AgentFlow):
    name = "tool-agent"

    def __init__(self, config: Config | None = None, *, max_turns: int | None = None, max_tokens: int | None = None,
                 temperature: float = 1.0, model: str = "policy", env_factory: EnvFactory | None = None):
        """`max_turns` bounds the model calls of a rollout (default: the config's `envs.max_turns`,
        so that a flow built from a config alone, as `train-flow` does, follows it);
        `env_factory(task)` builds its env (default: the env the task names)."""
        super().__init__(config)
        if max_turns is None:
            max_turns = self.config.envs.max_turns
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns, self.max_tokens, self.temperature, self.model = max_turns, max_tokens, temperature, model
        self.env_factory = env_factory or env_for(self.config)

    def run(self, task: Task, client: openai.OpenAI) -> float | None:
        return self.episode(task, client).outcome

    def episode(self, task: Task, client: openai.OpenAI) -> Episode:
        """One rollout of `task`, with what an evaluation reads besides the outcome."""
        calls_made = errors = turns = 0
        mistakes: collections.Counter[str] = collections.Counter()
        with self.env_factory(task) as env:
            prompt = env.reset(task)  # first: the system prompt describes the task's tools
            messages: list[dict[str, Any]] = [{"role": "system", "content": env.system},
                                              {"role": "user", "content": prompt}]
            tools = env.tools() or None
            final: str | None = None  # the last reply's text; `answer`, the same unless it was an unparsed call
            answer: str | None = None
            response = None
            for _ in range(self.max_turns):
                extra: dict[str, Any] = {"tools": tools} if tools else {}
                if self.max_tokens:
                    extra["max_tokens"] = self.max_tokens
                response = client.chat.completions.create(model=self.model, messages=messages,
                                                          temperature=self.temperature, **extra)
                turns += 1
                reply = response.choices[0].message
                final = answer = reply.content
                calls = reply.tool_calls or []
                message: dict[str, Any] = {"role": "assistant", "content": reply.content or ""}
                if calls:
                    message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                        "name": c.function.name, "arguments": c.function.arguments}} for c in calls]
                messages.append(message)
                if not calls:
                    if looks_like_call(reply.content or ""):
                        # A call in all but form is no answer, though it may spell the result out:
                        # Qwen re-calls the calculator with the result it was given (`"expression":
                        # "1848"`), and a checker reading the text would count that as solved.
                        mistakes["unparsed_call"] += 1
                        answer = None
                    break
                for call in calls:
                    result = env.call(call.function.name, call.function.arguments)
                    calls_made, errors = calls_made + 1, errors + env.failed(result)
                    if kind := call_mistake(result):
                        mistakes[kind] += 1
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            return Episode(outcome=env.outcome(answer), final=final or "", turns=turns, tool_calls=calls_made,
                           tool_errors=errors, last_id=response.id if response else "",
                           version=(response.system_fingerprint or "") if response else "",
                           mistakes=dict(mistakes))


def looks_like_call(text: str) -> bool:
    """Text that tried to be a tool call and was not taken as one: a JSON object naming a function
    (with more after it, cut off, or broken) or a `<tool_call>` tag the parser could not read."""
    return "<tool_call>" in text or ("{" in text and '"name"' in text)


@dataclass(frozen=True)
class Episode:
    """A rollout's outcome and its traces: the final answer, model calls, tool calls and how many
    of them came back as errors, and the last completion's id and policy version."""

    outcome: float
    final: str
    turns: int
    tool_calls: int
    tool_errors: int
    last_id: str
    version: str
    #: What went wrong with the form of its calls, counted: 'unparsed_call' (a final reply that
    #: was a call in all but form), 'wrong_tool', 'bad_arguments' (`envs.tools.call_mistake`).
    mistakes: dict[str, int] = field(default_factory=dict)
