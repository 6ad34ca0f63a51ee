"""Outrider: one engine for every speculative-decoding method, lossless and measured side by side."""

from .llm import LLM, Completion
from .errors import ConfigError, ModelError, OutriderError
from .sampling import SamplingParams

__all__ = ["LLM", "Completion", "SamplingParams", "OutriderError", "ConfigError", "ModelError"]
__version__ = "0.1.0"
