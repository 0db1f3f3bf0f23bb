"""LLMEngine's request intake: a request made (validated, tokenized), queued, aborted, or
ended when its deadline passes."""
from __future__ import annotations

import heapq
import itertools
import time

from ..core.block_manager import root_block_hash
from ..core.scheduler import Scheduler
from ..core.sequence import Sequence, SequenceStatus
from ..engine_config import EngineConfig
from ..errors import EngineOverloadedError, ErrorKind, RequestError, overloaded_message
from ..lora_request import LoRARequest
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..worker.executor import Executor
from .input_processor import InputProcessor
from .kv_connector import KVConnector, kv_transfer_params
from .metrics import EngineStats
from .output_processor import OutputProcessor
from .request import Request
from .structured_output import Grammar


class Deadlines:
    """Requests with a deadline, soonest first. A request that ends before its deadline stays
    until the deadline passes (the engine then finds it gone)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request]] = []  # (deadline, tie-breaker, request)
        self._order = itertools.count()

    def __bool__(self) -> bool:
        return bool(self._heap)

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.deadline, next(self._order), req))

    def pop_expired(self, now: float) -> list[Request]:
        """The requests whose deadline is `now` or earlier, soonest first."""
        expired = []
        while self._heap and self._heap[0][0] <= now:
            expired.append(heapq.heappop(self._heap)[2])
        return expired


class RequestIntake:
    """LLMEngine's requests, mixed into LLMEngine, which builds what they use (below)."""

    config: EngineConfig
    executor: Executor
    input_processor: InputProcessor
    output_processor: OutputProcessor
    scheduler: Scheduler
    stats: EngineStats
    requests: dict[str, Request]
    _deadlines: Deadlines
    kv_connector: KVConnector | None

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     arrival_time: float | None = None, priority: int = 0,
                     lora_request: LoRARequest | str | None = None,
                     deadline: float | None = None) -> Request:
        """Validate and tokenize (ValueError with a clear message). Touches no engine state,
        except that a LoRARequest with a `lora_path` the engine does not serve yet adds that
        adapter (read from disk now)."""
        if isinstance(lora_request, LoRARequest) and lora_request.lora_path and self.executor.lora_manager:
            self.executor.lora_manager.add_adapter(lora_request.lora_name, lora_request.lora_path)
            if lora_request.lora_name not in self.input_processor.lora_names:
                self.input_processor.lora_names += (lora_request.lora_name,)
        return self.input_processor.process(request_id, prompt, params, arrival_time, priority,
                                            lora_request, deadline)

    def add_request(self, request_id: str, prompt: str | list[int] | Request,
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    priority: int = 0, lora_request: LoRARequest | str | None = None,
                    deadline: float | None = None) -> None:
        """priority: with scheduling_policy="priority", lower values are served first.
        lora_request: an adapter of `lora_modules` or one added before (a LoRARequest or its
        name), or a new one: a LoRARequest with its `lora_path`. deadline: wall-clock time
        (time.time()) after which the request ends with an error, waiting or running.
        Raises EngineOverloadedError when max_waiting_requests requests are waiting."""
        req = prompt if isinstance(prompt, Request) else self.make_request(
            request_id, prompt, params, arrival_time, priority, lora_request, deadline)
        bound = self.config.scheduler_config.max_waiting_requests
        if bound is not None and len(self.scheduler.waiting) >= bound:
            self.stats.num_requests_rejected += 1
            raise EngineOverloadedError(overloaded_message(bound))
        self.enqueue(req)

    def enqueue(self, req: Request) -> None:
        """Add a request made by `make_request` (or a driver's InputProcessor) to the waiting
        queue; the drivers have applied the waiting bound already."""
        if req.request_id in self.requests:
            raise ValueError(f"Request id {req.request_id!r} is already in use.")
        seq = Sequence(req.request_id, req.prompt_token_ids, len(req.prompt_token_ids), req.params,
                       0, req.metrics.arrival_time, req.priority)
        seq.prompt_block_hashes = req.block_hashes
        if req.lora_name is not None or req.params.cache_salt is not None:
            seq.block_hash_root = root_block_hash(req.lora_name, req.params.cache_salt)
        if req.lora_name is not None:  # the scheduler gives it a slot when it runs
            seq.lora_name = req.lora_name
        if req.params.structured_outputs is not None:  # compiled when the request was checked
            seq.grammar = Grammar(self.input_processor.structured.compile(req.params.structured_outputs))
        if self.kv_connector is not None:
            self.kv_connector.prepare(seq)
        elif kv_transfer_params(req.params):
            raise ValueError("kv_transfer_params needs an engine started with kv_transfer_config.")
        self.output_processor.attach_detokenizer(seq, req)
        req.seqs.append(seq)
        self.requests[req.request_id] = req
        self.scheduler.add(seq)
        if req.deadline is not None:
            self._deadlines.add(req)

    def abort_request(self, request_id: str, error: RequestError | None = None) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            seq.drop_unresolved()  # tokens of an in-flight step are not waited for
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
            if not seq.is_finished:
                self.scheduler.finish(seq)  # safe with a step in flight: the stream orders reuse
        req.error = error
        self.output_processor.record_finished(req)
        return req.make_delta_output()

    def _expire(self, outputs: list[RequestOutput]) -> None:
        """End the requests whose deadline has passed, waiting or running, freeing their blocks
        (a launched step's tokens for them are dropped on arrival)."""
        now = time.time()
        for req in self._deadlines.pop_expired(now):
            if self.requests.get(req.request_id) is not req:
                continue  # finished or aborted already
            running = any(s.status == SequenceStatus.RUNNING or s.first_scheduled_time is not None
                          for s in req.seqs)
            waited = now - req.metrics.arrival_time
            out = self.abort_request(req.request_id, error=RequestError(
                f"Request timed out: its deadline passed while it was "
                f"{'running' if running else 'waiting to be scheduled'} ({waited:.3f} s after arrival).",
                ErrorKind.TIMEOUT))
            self.stats.num_requests_timed_out += 1
            if out is not None:
                outputs.append(out)

