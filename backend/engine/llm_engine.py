"""LLMEngine: requests in, one step at a time: schedule, run the model, process the tokens."""
from __future__ import annotations

import heapq
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable

from ..config import EngineArgs
from ..engine_config import EngineConfig, EngineLimits
from ..errors import EngineOverloadedError, ErrorKind, RequestError, overloaded_message
from ..lora_request import LoRARequest
from ..models import model_limits
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..spec_decode.metrics import record_verification
from ..spec_decode.ngram import NgramProposer
from ..spec_decode.proposer import TokenProposer, gather_proposals
from ..spec_decode.verification import num_accepted
from ..spec_decode.vocabulary import check_draft_vocabulary
from ..worker.executor import Executor
from ..step import SampleResult
from ..worker.pending_step import PendingStep
from .block_manager import BlockManager, root_block_hash
from .input_processor import InputProcessor, load_eos_token_ids
from .lora_slots import LoRASlots
from .metrics import EngineStats
from .output_processor import OutputProcessor
from .request import Request, make_logprobs_entry
from .scheduler import Scheduler
from .scheduler_output import SchedulerOutput
from .sequence import PLACEHOLDER, Sequence, SequenceStatus
from .structured_output import Grammar, grammar_bitmask
from .tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class InflightStep:
    """A launched step as the engine tracks it: its plan, the executor's handle, the sequences
    it names (by id: the step itself carries ids only), and where each sample row's token goes in
    its sequence."""
    step: SchedulerOutput
    pending: PendingStep
    positions: list[int]
    seqs: dict[int, Sequence]

    @property
    def speculative(self) -> bool:
        return bool(self.step.spec_runs)


class LLMEngine:
    """Synchronous engine. Not thread-safe: an `EngineCore` drives it from one thread.

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
        # Requests with a deadline, soonest first: (deadline, tie-breaker, request).
        self._deadlines: list[tuple[float, int, Request]] = []
        self._deadline_order = itertools.count()
        self.stats = EngineStats()
        self._tokens_counted = 0  # prompt + generation tokens when the last step was recorded
        self.output_processor = OutputProcessor(self.config.scheduler_config, model.max_model_len, self.tokenizer,
                                                self.scheduler, self.stats, detokenize)
        self._inflight: InflightStep | None = None  # the launched step whose tokens are not yet taken
        self.device_wait_s = 0.0  # host time spent waiting for launched steps to finish
        # Speculate while the running sequences fit one verification graph (eager verification
        # costs more than it gains).
        graphs = self.executor.verify_graphs
        self.max_speculating_seqs = graphs.max_seqs if graphs else self.config.scheduler_config.max_num_seqs

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.input_processor.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: tuple[int, ...]) -> None:
        self.input_processor.eos_token_ids = tuple(ids)

    # ---- requests -----------------------------------------------------------------------------
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
        self.output_processor.attach_detokenizer(seq, req)
        req.seqs.append(seq)
        self.requests[req.request_id] = req
        self.scheduler.add(seq)
        if req.deadline is not None:
            heapq.heappush(self._deadlines, (req.deadline, next(self._deadline_order), req))

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

    def shutdown(self) -> None:
        """Release what outlives the object: the other tensor-parallel ranks' processes and the
        process group; the grammar warm-up thread is waited for."""
        self.executor.shutdown()
        self.input_processor.structured.join_warm_up(timeout=30.0)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._inflight is not None

    # ---- the step -----------------------------------------------------------------------------
    def step(self, deliver: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """One iteration of the pipeline: schedule and launch step N+1 while step N still runs
        on the device (its sampled tokens feed N+1's inputs on the device), then wait for step
        N, take its tokens, and turn them into text and outputs while N+1 runs.

        When a running request's sampling reads its previous tokens on the host (bad words of
        several tokens, a grammar), step N+1's forward pass is launched alone and its
        sampling once step N's tokens are taken, still before N+1's forward is done. With
        `deliver`, outputs are handed over as soon as they are made (the device still busy);
        otherwise they are returned."""
        outputs: list[RequestOutput] = []
        if self._deadlines:
            self._expire(outputs)
        proposals = None
        if self.proposer is not None or self.drafts_in_worker:
            # Proposals continue from the latest tokens: take the step in flight first (no overlap).
            # Past a verification graph's size the batch decodes plainly (n-gram: pipelined).
            speculate = len(self.scheduler.running) <= self.max_speculating_seqs
            if self._inflight is not None and (speculate or self._inflight.speculative or self.drafts_in_worker):
                previous, self._inflight = self._inflight, None
                self._take_results(previous, outputs)
            if speculate:
                proposals = self._propose()
        step = self.scheduler.schedule(proposals, step_in_flight=self._inflight is not None)
        step.propose_drafts = len(self.scheduler.running) <= self.max_speculating_seqs
        launched = None if step.is_empty else self._launch(step, outputs)
        previous, self._inflight = self._inflight, launched
        if previous is not None:
            self._take_results(previous, outputs)
        if launched is not None and launched.pending.deferred:
            self._sample_deferred(launched, outputs)
        outputs += self.output_processor.process(self.requests)
        st = self.stats
        tokens = st.prompt_tokens + st.generation_tokens
        if tokens > self._tokens_counted:
            st.iteration_tokens.append(tokens - self._tokens_counted)
            self._tokens_counted = tokens
        if deliver is not None:
            deliver(outputs)
            return []
        return outputs

    def _expire(self, outputs: list[RequestOutput]) -> None:
        """End the requests whose deadline has passed, waiting or running, freeing their blocks
        (a launched step's tokens for them are dropped on arrival)."""
        now = time.time()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, req = heapq.heappop(self._deadlines)
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

    def _propose(self) -> dict[int, list[int]]:
        """Speculative decoding: proposed tokens for each running decode: n-gram lookup's, or the
        draft model's from the last step."""
        return gather_proposals(self.scheduler.running, self.max_seq_len, self.proposer, self._draft_token_ids)

    def _sample_deferred(self, inflight: InflightStep, outputs: list[RequestOutput]) -> None:
        try:
            inflight.pending.sample(grammar_bitmask(inflight.step, inflight.seqs, self.vocab_size))
        except Exception as exc:  # fail this batch's requests, keep serving the others
            logger.exception("model step failed")
            self._fail(inflight.step, inflight.seqs, _model_failed(exc), outputs)
            self._inflight = None

    def _launch(self, step: SchedulerOutput, outputs: list[RequestOutput]) -> InflightStep | None:
        """Queue the step on the device, then book it as done: computed tokens, forked
        siblings, a placeholder per sample row, length limits known now."""
        sequence = self.scheduler.sequence
        seqs = {item.seq_id: sequence(item.seq_id) for item in step.scheduled}
        seqs.update((row.seq_id, sequence(row.seq_id)) for row in step.sample_rows)  # forked siblings
        try:
            if not step.defer_sampling:  # (a deferred sampling's masks wait for the tokens before)
                step.grammar_bitmask = grammar_bitmask(step, seqs, self.vocab_size)
            pending = self.executor.execute_model(step)
        except Exception as exc:  # fail this batch's requests, keep serving the others
            logger.exception("model step failed")
            self._fail(step, seqs, _model_failed(exc), outputs)
            return None
        self.scheduler.update_after_step(step)
        for fork in step.forks:
            req = self.requests[seqs[fork.parent].request_id]
            for child_id in fork.children:
                child = seqs[child_id]
                self.output_processor.attach_detokenizer(child, req)
                req.seqs.append(child)
        speculating = {run.seq_id for run in step.spec_runs}
        positions = []
        for row in step.sample_rows:
            seq = seqs[row.seq_id]
            positions.append(seq.add_placeholder())
            if seq.seq_id in speculating:
                continue  # how many of its rows become tokens is known on arrival (`_verify`)
            self._finish_at_length_limit(seq)  # known now: free its blocks, do not schedule it again
        return InflightStep(step, pending, positions, seqs)

    def _fail(self, step: SchedulerOutput, seqs: dict[int, Sequence], error: RequestError,
              outputs: list[RequestOutput]) -> None:
        self.block_manager.reset_prefix_cache()
        for rid in {seqs[item.seq_id].request_id for item in step.scheduled}:
            out = self.abort_request(rid, error=error)
            if out is not None:
                outputs.append(out)

    def _take_results(self, inflight: InflightStep, outputs: list[RequestOutput]) -> None:
        """Wait for a launched step and put its sampled tokens in place of the placeholders."""
        try:
            result = inflight.pending.wait()
            self.device_wait_s += inflight.pending.waited_s
        except Exception as exc:
            logger.exception("model step failed")
            self._fail(inflight.step, inflight.seqs, _model_failed(exc), outputs)
            return
        seqs = inflight.seqs
        self._draft_token_ids = result.draft_token_ids
        for seq_id, entry in result.prompt_logprobs.items():
            seq = seqs[seq_id]
            # In order: a prompt's chunks are taken in the order they were launched.
            if seq.request_id in self.requests and entry.first == len(seq.prompt_logprobs):
                seq.prompt_logprobs.extend(make_logprobs_entry(r.token_id, r.logprob, r.rank, r.top)
                                           for r in entry.results)
        if inflight.speculative:
            self._verify(inflight, result.sampled)
        now = time.time()
        off_grammar: dict[str, int] = {}  # request id -> the token its grammar rejected
        taken: dict[int, int] = {}  # seq_id -> its results taken so far (a verification run has several)
        for row, pos in zip(inflight.step.sample_rows, inflight.positions):
            seq = seqs[row.seq_id]
            j = taken[seq.seq_id] = taken.get(seq.seq_id, -1) + 1
            res = result.sampled[seq.seq_id][j]
            req = self.requests.get(seq.request_id)
            if req is None or pos >= seq.num_tokens or seq.token_ids[pos] != PLACEHOLDER:
                continue  # aborted, or stopped at an earlier token: this one is past the end
            seq.token_ids[pos] = res.token_id
            seq.num_unresolved -= 1
            if seq.grammar is not None and not seq.grammar.accept(res.token_id):
                off_grammar.setdefault(req.request_id, res.token_id)
            self.output_processor.record_token(seq, req, res, now)
            p = seq.params
            n_out = pos + 1 - seq.num_prompt_tokens
            if res.token_id in p.all_stop_token_ids and n_out >= p.min_tokens and \
                    seq.finish_reason in (None, "length"):
                seq.finish_reason = "stop"
                seq.stop_reason = res.token_id if res.token_id in p.stop_token_ids else None
                seq.num_text_tokens = n_out - 1  # the stop token itself has no text
                del seq.token_ids[pos + 1:]  # a sample of the step in flight, if any
                seq.num_unresolved = 0
                if not seq.is_finished:
                    self.scheduler.finish(seq)
            elif not seq.is_finished:
                self.block_manager.cache_full_blocks(seq)
        for run in inflight.step.spec_runs:  # length limits of speculating sequences, now known
            seq = seqs[run.seq_id]
            if seq.request_id in self.requests and not seq.is_finished:
                self._finish_at_length_limit(seq)
        for request_id, token in off_grammar.items():  # that request ends; the others carry on
            out = self.abort_request(request_id, error=RequestError(
                f"structured_outputs: the grammar allows no continuation (sampled token {token}).",
                ErrorKind.INVALID_ARGUMENT, "structured_outputs"))
            if out is not None:
                outputs.append(out)

    def _finish_at_length_limit(self, seq: Sequence) -> None:
        p = seq.params
        if (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or \
                seq.num_tokens >= self.max_seq_len:
            seq.finish_reason = "length"
            self.scheduler.finish(seq)

    def _verify(self, inflight: InflightStep, results: dict[int, list[SampleResult]]) -> None:
        """Speculative decoding: a sequence keeps its tokens up to the first that differs from
        the proposal, and that one (greedy rows took the argmax; sampled rows kept the proposal
        or drew from the rest: backend/spec_decode/verification.py); the placeholders of the
        rest go, and the accepted proposals' keys and values count as computed."""
        positions = inflight.positions
        for run in inflight.step.spec_runs:
            seq, proposed, first = inflight.seqs[run.seq_id], run.proposed, run.first_row
            if seq.request_id not in self.requests or seq.is_finished:
                continue
            accepted = num_accepted(results[seq.seq_id], proposed)
            del seq.token_ids[positions[first + accepted] + 1:positions[first + len(proposed)] + 1]
            seq.num_unresolved -= len(proposed) - accepted
            seq.num_computed_tokens += accepted
            record_verification(self.stats, len(proposed), accepted)

    # ---- stats ----------------------------------------------------------------------------------
    def _lora_stats(self) -> dict:
        slots = self.scheduler.lora_slots
        if slots is None:
            return {}

        def names(seqs) -> str:
            return ",".join(sorted({s.lora_name for s in seqs if s.lora_name is not None}))
        return {"max_lora": len(slots.names), "running_lora_adapters": names(self.scheduler.running),
                "waiting_lora_adapters": names(self.scheduler.waiting)}

    def get_stats(self) -> EngineStats:
        """Gauges and counters now; latency samples since the previous call."""
        s = self.stats
        snapshot = EngineStats(
            num_running=len(self.scheduler.running), num_waiting=self.scheduler.num_waiting_unswapped,
            kv_cache_usage=self.block_manager.usage,
            prefix_cache_queries=self.block_manager.prefix_cache_queries,
            prefix_cache_hits=self.block_manager.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens, request_success=dict(s.request_success),
            num_requests_rejected=s.num_requests_rejected, num_requests_timed_out=s.num_requests_timed_out,
            spec_decode_num_drafts=s.spec_decode_num_drafts, spec_decode_num_draft_tokens=s.spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens=s.spec_decode_num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(s.spec_decode_num_accepted_tokens_per_pos),
            **self._lora_stats(), **self.scheduler.swap_stats(), **{
                name: getattr(s, name) for name in EngineStats.SAMPLE_FIELDS})
        for name in EngineStats.SAMPLE_FIELDS:
            setattr(s, name, [])
        return snapshot


def _model_failed(exc: Exception) -> RequestError:
    return RequestError(f"internal error while running the model: {exc}", ErrorKind.INTERNAL)
