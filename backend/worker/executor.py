"""Executors: what the engine drives. One model on one device (`UniProcExecutor`) or split over
tensor-parallel ranks (`TensorParallelExecutor`); the engine sees the same surface either way:
`execute_model`, the KV cache's size, the LoRA adapters, `shutdown`."""
from __future__ import annotations

import importlib

from ..engine_config import EngineConfig
from ..step import SchedulerOutput
from .compile_watch import CompileWatch
from .cuda_graph import PrefillGraphs
from .device import resolve_device
from .lora import LoRAManager
from .model_runner import ModelRunner
from .pending_step import PendingStep
from .worker import Worker
from .worker_group import RankFailed, WorkerGroup


class Executor:
    """Rank 0's Worker and what the engine reads of it. `Executor.create` picks the kind."""

    worker: Worker

    @staticmethod
    def create(config: EngineConfig) -> Executor:
        return Executor.get_class(config)(config)

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        """The class `distributed_executor_backend` names (vLLM's meaning): "uni", "mp", or
        an Executor subclass's qualified name (a ValueError names what is wrong with it)."""
        backend = config.parallel_config.distributed_executor_backend
        if backend == "uni":
            return UniProcExecutor
        if backend == "mp":
            return TensorParallelExecutor
        module_name, _, class_name = backend.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"distributed_executor_backend={backend!r}: cannot import it: {e}") from None
        if not (isinstance(cls, type) and issubclass(cls, Executor)):
            raise ValueError(f"distributed_executor_backend={backend!r} is not a subclass of "
                             f"tritium.worker.executor.Executor.")
        return cls

    @property
    def runner(self) -> ModelRunner:
        return self.worker.runner

    @property
    def num_blocks(self) -> int:
        """KV cache blocks (each rank holds its heads' part of every block)."""
        return self.worker.num_blocks

    @property
    def kv_transfer(self):
        """The KV cache's NIXL side for disaggregated prefill (None: not configured)."""
        return self.worker.kv_transfer

    @property
    def kv_sliding_window(self) -> int | None:
        """Past tokens every layer's attention is limited to (None: some layer sees them all),
        for the block manager to give back blocks behind it."""
        return self.worker.kv_sliding_window

    @property
    def num_host_blocks(self) -> int:
        """Host blocks for preemption by swap (each rank holds its part of every one)."""
        return self.worker.num_host_blocks

    @property
    def vocab_size(self) -> int:
        return self.worker.vocab_size

    @property
    def lora_manager(self) -> LoRAManager | None:
        return self.worker.lora_manager

    @property
    def verify_graphs(self) -> PrefillGraphs | None:
        """Speculative decoding's verification graphs (None: verification runs eagerly)."""
        return self.runner.verify_graphs

    @property
    def compile_watch(self) -> CompileWatch:
        return self.worker.compile_watch

    def execute_model(self, step: SchedulerOutput) -> PendingStep:
        """Queue the step and return at once (`ModelRunner.execute_model`)."""
        return self.worker.execute_model(step)

    def shutdown(self) -> None:
        """Release what outlives the executor (nothing with one device)."""


class UniProcExecutor(Executor):
    """The model on one device, in this process."""

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)


class TensorParallelExecutor(Executor):
    """Rank 0's Worker in this process and ranks 1..N-1 (`WorkerGroup`) in theirs. Every rank
    builds in lockstep; from then on each step goes to every rank as the scheduler made it, and
    rank 0's runner tells the ranks its LM-head calls (its `mirror`)."""

    def __init__(self, config: EngineConfig) -> None:
        self.workers = WorkerGroup(config, resolve_device(config.device_config))
        try:
            self.worker = Worker(config, rank=0, link=self.workers)
        except BaseException:
            self.workers.shutdown()
            raise
        self.worker.runner.mirror = self.workers

    def execute_model(self, step: SchedulerOutput) -> PendingStep:
        """As one device's; RankFailed once a rank is lost (and for every step after)."""
        workers = self.workers
        workers.check()
        try:
            workers.step(step, {name: self.lora_manager.paths[name] for _, name in step.lora_loads})
            return self.worker.execute_model(step)
        except RankFailed:
            raise
        except Exception as exc:  # the ranks' collectives are out of step from here on
            raise workers.failed(exc) from exc

    def shutdown(self) -> None:
        """Stop the other ranks and leave the process group; idempotent. Rank 0's CUDA graphs
        (which hold captured NCCL work) go first, before the communicator is destroyed."""
        runner = self.worker.runner
        runner.graphs = runner.prefill_graphs = runner.verify_graphs = None
        self.workers.shutdown()
