"""Offline modes: white-box flows trained with GRPO groups (`train-flow`) and a black-box runner
that drives any external agent over a task set (`run-agent`). Both reach the model only through
the gateway, as any agent would."""

from clawr1.flows.base import AgentFlow
from clawr1.flows.registry import load_flow, registry
from clawr1.flows.tool_agent import ToolAgentFlow

__all__ = ["AgentFlow", "ToolAgentFlow", "load_flow", "registry"]
