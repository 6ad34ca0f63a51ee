"""Outrider: one engine for every speculative-decoding method, lossless and measured side by side."""

from .config import RuntimeConfig
from .errors import ConfigError, ModelError, OutriderError
from .llm import LLM, Completion
from .sampling import SamplingParams

__all__ = ["LLM", "Completion", "SamplingParams", "RuntimeConfig", "OutriderError", "ConfigError", "ModelError"]
__version__ = "0.1.0"
