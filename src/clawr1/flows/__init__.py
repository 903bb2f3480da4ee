"""Agent flows for the offline modes: the `AgentFlow` contract, the registry, rollout ids and
held-out task evaluation. Flows reach the model only through the gateway, as any agent would; the
runners that serve the stack and train (`train-flow`, `run-agent`) are `clawr1.entrypoints`."""

from clawr1.flows.base import AgentFlow
from clawr1.flows.registry import load_flow, registry
from clawr1.flows.tool_agent import ToolAgentFlow

__all__ = ["AgentFlow", "ToolAgentFlow", "load_flow", "registry"]
