"""The data model and configuration shared by every role. Imports no role."""

from clawr1.core.config import Config, EngineConfig, load_config
from clawr1.core.types import (
    AdapterError,
    ContextLengthError,
    EngineError,
    EngineFailure,
    EngineOverloadedError,
    Generation,
    InvalidRequestError,
    ParsedCompletion,
    SamplingParams,
    TokenEvent,
    ToolCall,
    UnknownAdapterError,
)

__all__ = [
    "AdapterError",
    "Config",
    "ContextLengthError",
    "EngineConfig",
    "EngineError",
    "EngineFailure",
    "EngineOverloadedError",
    "Generation",
    "InvalidRequestError",
    "ParsedCompletion",
    "SamplingParams",
    "TokenEvent",
    "ToolCall",
    "UnknownAdapterError",
    "load_config",
]
