"""LLMEngine: requests in, one step at a time: schedule, run the model, process the tokens.

Built here; its jobs live in their own modules: the request intake (request_intake.py), the
pipelined step (step_pipeline.py), the statistics (stats_snapshot.py)."""
from __future__ import annotations

from ..config import EngineArgs
from ..core.block_manager import BlockManager
from ..core.lora_slots import LoRASlots
from ..core.scheduler import Scheduler
from ..engine_config import EngineConfig, EngineLimits
from ..errors import RequestError
from ..models import model_limits
from ..outputs import RequestOutput
from ..spec_decode.ngram import NgramProposer
from ..spec_decode.proposer import TokenProposer
from ..spec_decode.vocabulary import check_draft_vocabulary
from ..worker.executor import Executor
from .input_processor import InputProcessor, load_eos_token_ids
from .kv_connector import KVConnector
from .metrics import EngineStats
from .output_processor import OutputProcessor
from .request import Request
from .request_intake import Deadlines, RequestIntake
from .stats_snapshot import snapshot_stats
from .step_pipeline import InflightStep, StepPipeline
from .tokenizer import load_tokenizer


class LLMEngine(RequestIntake, StepPipeline):
    """Synchronous engine. Not thread-safe: an `EngineCore` drives it from one thread.

    Requests: make_request, add_request, enqueue, abort_request (RequestIntake); the step: step
    (StepPipeline); get_stats, has_unfinished_requests, shutdown.
    detokenize=False: see OutputProcessor (the engine process's parent makes the text)."""

    def __init__(self, args: EngineArgs, detokenize: bool = True) -> None:
        self.config: EngineConfig = args.create_engine_config(args.create_model_config(model_limits))
        model, cache = self.config.model_config, self.config.cache_config
        self.hf_config = model.hf_config
        self.tokenizer = load_tokenizer(model.tokenizer)
        check_draft_vocabulary(self.config.speculative_config, self.tokenizer, self.hf_config)  # before loading it
        self.executor = Executor.create(self.config)  # one device, or tensor-parallel ranks
        self.vocab_size = self.executor.vocab_size
        self.block_manager = BlockManager(self.executor.num_blocks, cache.block_size,
                                          cache.enable_prefix_caching, self.executor.kv_sliding_window)
        lora, spec = self.executor.lora_manager, self.config.speculative_config
        # n-gram lookup proposes here; a draft model in the worker, after each step (its last
        # proposals: `_draft_token_ids`), into lookahead slots the scheduler adds.
        self.drafts_in_worker = bool(spec and spec.uses_draft_model)
        self.proposer: TokenProposer | None = NgramProposer(spec) if spec and not self.drafts_in_worker else None
        self._draft_token_ids: dict[int, list[int]] = {}
        self.scheduler = Scheduler(self.config.scheduler_config, self.block_manager, LoRASlots(
            lora.num_slots, lora.resident) if lora else None, spec.num_speculative_tokens if self.drafts_in_worker
            else 0, self.executor.num_host_blocks)
        # A sequence can never outgrow the whole cache: it would preempt itself forever.
        capacity = self.block_manager.max_sequence_tokens(self.config.scheduler_config.max_num_batched_tokens)
        self.max_seq_len = capacity = min(model.max_model_len, capacity or model.max_model_len)
        self.limits = EngineLimits(self.vocab_size, capacity,
                                   load_eos_token_ids(model.model, self.hf_config, self.tokenizer))
        self.input_processor = InputProcessor(self.config, self.tokenizer, self.limits)
        self.input_processor.structured.warm_up_in_background()
        self.requests: dict[str, Request] = {}
        self._deadlines = Deadlines()
        self.stats = EngineStats()
        self._tokens_counted = 0  # prompt + generation tokens when the last step was recorded
        self.output_processor = OutputProcessor(self.config.scheduler_config, model.max_model_len, self.tokenizer,
                                                self.scheduler, self.stats, detokenize)
        self._inflight: InflightStep | None = None  # the launched step whose tokens are not yet taken
        self.device_wait_s = 0.0  # host time spent waiting for launched steps to finish
        # Speculate while the running sequences fit one verification graph (eager verification
        # costs more than it gains).
        # Disaggregated prefill (kv_transfer_config): a failed read ends its request with an
        # error, delivered with the next step's outputs.
        self.kv_failures: list[RequestOutput] = []
        self.kv_connector = KVConnector(
            self.config.kv_transfer_config, self.executor.kv_transfer, self.scheduler, self.block_manager,
            self.requests, self._fail_transfer) if self.config.kv_transfer_config is not None else None
        graphs = self.executor.verify_graphs
        self.max_speculating_seqs = graphs.max_seqs if graphs else self.config.scheduler_config.max_num_seqs

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.input_processor.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: tuple[int, ...]) -> None:
        self.input_processor.eos_token_ids = tuple(ids)

    def shutdown(self) -> None:
        """Release what outlives the object: the other tensor-parallel ranks' processes and the
        process group; the grammar warm-up thread is waited for."""
        self.executor.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.transfer.close()
        self.input_processor.structured.join_warm_up(timeout=30.0)

    def has_unfinished_requests(self) -> bool:
        return (bool(self.requests) or self._inflight is not None
                or (self.kv_connector is not None and self.kv_connector.busy))

    def idle_poll(self) -> None:
        """Between commands while no request runs: a producer frees the blocks consumers have
        read since (its steps do this otherwise)."""
        if self.kv_connector is not None:
            self.kv_connector.poll()

    def _fail_transfer(self, request_id: str, error: RequestError) -> None:
        out = self.abort_request(request_id, error=error)
        if out is not None:
            self.kv_failures.append(out)

    def get_stats(self) -> EngineStats:
        """Gauges and counters now; latency samples since the previous call."""
        return snapshot_stats(self.stats, self.scheduler, self.block_manager,
                              self.kv_connector.stats() if self.kv_connector is not None else None)
