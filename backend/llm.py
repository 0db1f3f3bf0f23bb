"""LLM: the offline API, `LLM(model=...).generate(prompts, sampling_params)`."""
from __future__ import annotations

import gc
import itertools
import weakref
from typing import Any, Sequence as Seq

import torch

from .config import EngineArgs
from .errors import EngineShutdownError
from .engine.llm_engine import LLMEngine
from .lora_request import LoRARequest
from .engine.metrics_reader import Metric, metrics_from_stats
from .outputs import RequestOutput
from .engine.request import accumulate
from .sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Generate for a batch of prompts with continuous batching; any engine argument as keyword.

    It frees itself when shut down, when used as a context manager (`with LLM(...) as llm:`) or
    when collected: the tensor-parallel ranks' processes and process group, the engine's threads
    and its device memory; then another LLM, tensor-parallel or not, can start in this process."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self._engine: LLMEngine | None = LLMEngine(EngineArgs.from_kwargs(model=model, **kwargs))
        # Holds the engine, not the LLM: collecting the LLM runs it.
        self._finalizer = weakref.finalize(self, self._engine.shutdown)
        self._ids = itertools.count()

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise EngineShutdownError("This LLM was shut down; create a new one.")
        return self._engine

    def shutdown(self) -> None:
        """Free the engine now (see the class); idempotent."""
        self._finalizer()
        self._engine = None
        gc.collect()  # the engine's reference cycles hold its tensors
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges, as vLLM's LLM.get_metrics(): e.g. speculative
        decoding's acceptance, `vllm:spec_decode_num_accepted_tokens` over
        `vllm:spec_decode_num_draft_tokens`, and per position."""
        return metrics_from_stats(self.engine.get_stats())

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 priority: Seq[int] | None = None,
                 lora_request: LoRARequest | str | Seq[LoRARequest | str | None] | None = None
                 ) -> list[RequestOutput]:
        """priority: one per prompt, with scheduling_policy="priority" (lower values first).
        lora_request: a LoRA adapter (a LoRARequest or the name of one the engine serves:
        `lora_modules` or added before; a LoRARequest with a `lora_path` adds it) for every
        prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                         and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"Got {len(params)} sampling params for {len(prompts)} prompts.")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"Got {len(priority)} priorities for {len(prompts)} prompts.")
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"Got {len(loras)} LoRA requests for {len(prompts)} prompts.")
        # Validate everything before queueing anything, so a bad prompt leaves no half-done batch.
        requests = [self.engine.make_request(str(next(self._ids)), p, sp, priority=pr, lora_request=lo)
                    for p, sp, pr, lo in zip(prompts, params, priority, loras)]
        for req in requests:
            self.engine.add_request(req.request_id, req)
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                results[delta.request_id] = accumulate(results.get(delta.request_id), delta)
        return [results[r.request_id] for r in requests]
