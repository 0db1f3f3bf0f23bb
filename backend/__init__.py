"""Tritium engine: paged KV cache, prefix caching, continuous batching (vLLM's design).

The names that need torch (LLM, LLMEngine, StreamingEngine) load on first use, so the Triton stub,
which only talks to the engine's own process (EngineProcess), never imports torch.
"""
from importlib import import_module
from typing import Any

from .config import EngineArgs
from .errors import EngineOverloadedError, EngineShutdownError, ErrorKind, ParameterError, RequestError
from .lora_request import LoRARequest
from .engine.metrics import EngineStats
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

# EngineProcess too: its module imports transformers (the tokenizer), a second's work that
# `tritium` commands and the Triton stub's auto-complete do not need.
_LAZY = {"LLM": "llm", "LLMEngine": "engine.llm_engine", "StreamingEngine": "drivers.streaming_engine",
         "EngineProcess": "drivers.engine_process"}

__all__ = ["LLM", "LLMEngine", "StreamingEngine", "EngineProcess", "EngineArgs", "EngineStats", "SamplingParams",
           "RequestOutput", "CompletionOutput", "Logprob", "EngineShutdownError", "EngineOverloadedError",
           "ErrorKind", "RequestError", "ParameterError", "LoRARequest"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
