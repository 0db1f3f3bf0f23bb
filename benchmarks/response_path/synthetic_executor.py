"""SyntheticExecutor: an engine stand-in that emits tokens at a GPU's rate on a machine without
one, so that everything around the device (scheduler, output processing, text, the engine
process's messages, the Triton stub, its sender, gRPC) runs as in production and its cost can
be measured on the CPU. A benchmark tool, not part of the product: the engine picks it by
`distributed_executor_backend=benchmarks.response_path.synthetic_executor.SyntheticExecutor`.

A step occupies a simulated device for `step_ms + token_us * num_batched_tokens` from the
moment it is launched (or the previous step's end, whichever is later), and `wait()` sleeps
until then, as the real `PendingStep.wait()` blocks on a CUDA event without the GIL. Each
sampled token is a fixed function of the sequence and its count of tokens so far, inside the
tokenizer's ordinary ids, so every run streams the same text.

Timing comes from the environment (the engine's process inherits the server's):
TRITIUM_SYNTHETIC_STEP_MS and TRITIUM_SYNTHETIC_TOKEN_US. With TRITIUM_SYNTHETIC_TIMELINE=PATH
each step's launch and end (time.perf_counter(), one clock for every process of the machine),
batched tokens and sampled rows are written to PATH as JSON at shutdown. The defaults are
fitted to the H100's in-process run of Qwen2.5-1.5B on workload A (benchmarks/README.md gives
the arithmetic).
"""
from __future__ import annotations

import json
import math
import os
import time

from tritium.engine_config import EngineConfig
from tritium.step import ModelRunnerOutput, SampleResult, SchedulerOutput
from tritium.worker.compile_watch import CompileWatch
from tritium.worker.executor import Executor
from tritium.worker.pending_step import PendingStep

STEP_MS_ENV, TOKEN_US_ENV = "TRITIUM_SYNTHETIC_STEP_MS", "TRITIUM_SYNTHETIC_TOKEN_US"
TIMELINE_ENV = "TRITIUM_SYNTHETIC_TIMELINE"
DEFAULT_STEP_MS, DEFAULT_TOKEN_US = 7.8, 4.66
FIRST_TOKEN_ID = 3  # after the tiny tokenizer's special ids (unk, bos/eos, pad)


def synthetic_token(seq_id: int, index: int, vocab_size: int) -> int:
    """A sequence's `index`-th sampled token: ordinary ids only, varied, deterministic."""
    span = vocab_size - FIRST_TOKEN_ID
    return FIRST_TOKEN_ID + (seq_id * 7919 + index * 104729) % span


class SyntheticStep(PendingStep):
    """A launched synthetic step: its tokens are known at once, handed over at `done_at`."""

    def __init__(self, step: SchedulerOutput, done_at: float, tokens: list[int]) -> None:
        super().__init__(step)
        self.done_at = done_at
        self._tokens = tokens

    @property
    def deferred(self) -> bool:
        return False  # the tokens do not depend on the host's view (no grammar masks apply)

    def wait(self) -> ModelRunnerOutput:
        delay = self.done_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # releases the GIL, as a CUDA event wait does
        self.waited_s = max(0.0, delay)
        out = ModelRunnerOutput()
        for seq_id, token in zip(self.seq_ids, self._tokens):
            out.sampled.setdefault(seq_id, []).append(SampleResult(token, 0.0, None, None))
        return out


class SyntheticExecutor(Executor):
    """Executor surface without a model: KV capacity for max_num_seqs sequences of
    max_model_len (or num_kv_blocks), the model's vocabulary, no LoRA, no graphs."""

    def __init__(self, config: EngineConfig) -> None:
        cache, model = config.cache_config, config.model_config
        per_seq = math.ceil(model.max_model_len / cache.block_size)
        self._num_blocks = cache.num_kv_blocks or config.scheduler_config.max_num_seqs * per_seq
        self._vocab_size = int(model.hf_config["vocab_size"])
        self._compile_watch = CompileWatch()
        self.step_s = float(os.environ.get(STEP_MS_ENV, DEFAULT_STEP_MS)) / 1e3
        self.token_s = float(os.environ.get(TOKEN_US_ENV, DEFAULT_TOKEN_US)) / 1e6
        self._device_free_at = 0.0
        self._sampled: dict[int, int] = {}  # tokens sampled so far, by sequence id
        self.timeline: list[tuple[float, float, int, int]] = []  # (launch, end, tokens, rows)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def kv_sliding_window(self) -> None:
        # No model, so no layer's attention is windowed: the block manager keeps every block.
        return None

    @property
    def num_host_blocks(self) -> int:
        return 0

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def lora_manager(self) -> None:
        return None

    @property
    def verify_graphs(self) -> None:
        return None

    @property
    def compile_watch(self) -> CompileWatch:
        return self._compile_watch

    def execute_model(self, step: SchedulerOutput) -> PendingStep:
        sampled = self._sampled
        for seq_id in step.finished_seq_ids:
            sampled.pop(seq_id, None)
        tokens = []
        for row in step.sample_rows:
            n = sampled.get(row.seq_id, 0)
            tokens.append(synthetic_token(row.seq_id, n, self._vocab_size))
            sampled[row.seq_id] = n + 1
        now = time.perf_counter()
        start = max(now, self._device_free_at)
        self._device_free_at = start + self.step_s + self.token_s * step.num_batched_tokens
        self.timeline.append((now, self._device_free_at, step.num_batched_tokens, len(tokens)))
        return SyntheticStep(step, self._device_free_at, tokens)

    def shutdown(self) -> None:
        path = os.environ.get(TIMELINE_ENV)
        if path:
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"steps": self.timeline}, f)
