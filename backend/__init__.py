"""Tritium engine: paged KV cache, prefix caching, continuous batching (vLLM's design)."""
from .config import EngineArgs
from .engine_process import EngineProcess
from .llm import LLM
from .llm_engine import LLMEngine
from .metrics import EngineStats
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams
from .streaming_engine import EngineShutdownError, StreamingEngine

__all__ = ["LLM", "LLMEngine", "StreamingEngine", "EngineProcess", "EngineArgs", "EngineStats", "SamplingParams",
           "RequestOutput", "CompletionOutput", "Logprob", "EngineShutdownError"]
