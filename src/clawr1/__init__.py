"""Claw-R1: runtime reinforcement learning for LLM agents.

Point any OpenAI-compatible agent at the gateway; every call is served and recorded token for
token, judged from the agent's next turn, and learned from in the background with LoRA.
"""

__version__ = "0.1.0"
