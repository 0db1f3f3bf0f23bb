"""LLMEngine: requests in, one step at a time: schedule, run the model, process the tokens."""
from __future__ import annotations

import logging
import time
from typing import Callable

from .block_manager import BlockManager
from ..config import EngineArgs, load_hf_config
from .input_processor import InputProcessor, load_eos_token_ids
from ..lora_request import LoRARequest
from .lora_slots import LoRASlots
from .metrics import EngineStats
from ..worker.model_runner import ModelRunner
from ..models import context_limit, longrope_original_length
from ..outputs import RequestOutput
from .request import Request, make_logprobs_entry
from ..sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import PLACEHOLDER, Sequence
from .spec_decode import NgramProposer
from .structured_output import Grammar
from .tokenizer import IncrementalDetokenizer, fill_decoded_tokens, find_stop_string, load_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


class LLMEngine:
    """Synchronous engine. Not thread-safe: `StreamingEngine` drives it from one thread.

    With `detokenize=False` the outputs of requests without stop strings carry token ids and no
    text: the engine process's parent turns them into text (`engine_process.OutputDetokenizer`),
    in parallel with the step loop. Requests with stop strings are detokenized here, where
    finding a stop string can end the sequence."""

    def __init__(self, args: EngineArgs, detokenize: bool = True) -> None:
        self.detokenize = detokenize
        self.hf_config = load_hf_config(args.model)
        self.tokenizer = load_tokenizer(args.tokenizer or args.model)
        max_pos = int(self.hf_config.get("max_position_embeddings") or 4096)
        limit = f"the model's max_position_embeddings={max_pos}"
        exact = context_limit(self.hf_config)
        if exact is not None and exact[0] < max_pos:
            max_pos, limit = exact
            logger.warning("Serving sequences of at most %d tokens: %s", max_pos, limit)
        if args.max_model_len is not None and args.max_model_len > max_pos:
            raise ValueError(f"max_model_len={args.max_model_len} is larger than {limit}.")
        max_model_len = args.max_model_len or max_pos
        original = longrope_original_length(self.hf_config)
        if original is not None and args.max_model_len is None and max_model_len > original:
            max_model_len = original
            logger.warning("LongRoPE: max_model_len defaults to original_max_position_embeddings=%d "
                           "(its short factors, as transformers uses them up to there); a larger "
                           "max_model_len uses the long factors at every position", original)
        elif original is not None and max_model_len > original:
            logger.warning("LongRoPE: max_model_len=%d passes original_max_position_embeddings=%d, so "
                           "the long factors apply at every position (vLLM's rule; transformers uses "
                           "the short ones while a sequence is shorter)", max_model_len, original)
        budget = args.max_num_batched_tokens or (
            DEFAULT_MAX_NUM_BATCHED_TOKENS if args.enable_chunked_prefill
            else max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS))
        if not args.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(f"max_num_batched_tokens={budget} is smaller than max_model_len="
                             f"{max_model_len}; without chunked prefill a whole prompt must fit "
                             f"in one step. Raise max_num_batched_tokens or enable_chunked_prefill.")
        self.args = args.replace(max_model_len=max_model_len, max_num_batched_tokens=budget)
        self.runner = ModelRunner(self.args, self.hf_config, max_model_len, budget)
        self.vocab_size = self.runner.vocab_size
        self.block_manager = BlockManager(self.runner.num_blocks, args.block_size,
                                          args.enable_prefix_caching)
        lora = self.runner.lora_manager
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, budget,
                                   args.enable_chunked_prefill, args.long_prefill_token_threshold,
                                   args.scheduling_policy,
                                   LoRASlots(lora.num_slots, lora.resident) if lora else None)
        # A sequence can never outgrow the whole cache: it would preempt itself forever.
        self.max_seq_len = min(max_model_len, self.runner.num_blocks * args.block_size)
        self.input_processor = InputProcessor(
            self.tokenizer, self.vocab_size, max_model_len, self.runner.num_blocks * args.block_size,
            args.max_num_seqs, args.max_logprobs,
            load_eos_token_ids(args.model, self.hf_config, self.tokenizer), args.scheduling_policy,
            args.tokenizer or args.model, lora_names=tuple(args.lora_modules or ()),
            lora_enabled=args.enable_lora)
        self.input_processor.structured.warm_up_in_background()
        self.requests: dict[str, Request] = {}
        self._text_queue: list[Sequence] = []  # sequences with tokens not yet turned into text
        self._inflight = None  # the launched step whose tokens are not yet taken
        self.device_wait_s = 0.0  # host time spent waiting for launched steps to finish
        self.stats = EngineStats()
        spec = args.speculative
        self.proposer = NgramProposer(spec) if spec else None
        # Speculate while the running sequences fit one verification graph (eager verification
        # costs more than it gains: H200, Llama-3-8B, 32 sequences at 0.28-0.76x of plain).
        graphs = self.runner.verify_graphs
        self.max_speculating_seqs = graphs.max_seqs if graphs is not None else args.max_num_seqs

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.input_processor.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: tuple[int, ...]) -> None:
        self.input_processor.eos_token_ids = tuple(ids)

    # ---- requests -----------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     arrival_time: float | None = None, priority: int = 0,
                     lora_request: LoRARequest | str | None = None) -> Request:
        """Validate and tokenize (ValueError with a clear message). Touches no engine state,
        except that a LoRARequest with a `lora_path` the engine does not serve yet adds that
        adapter (read from disk now)."""
        if isinstance(lora_request, LoRARequest) and lora_request.lora_path and self.runner.lora_manager:
            self.runner.lora_manager.add_adapter(lora_request.lora_name, lora_request.lora_path)
            if lora_request.lora_name not in self.input_processor.lora_names:
                self.input_processor.lora_names += (lora_request.lora_name,)
        return self.input_processor.process(request_id, prompt, params, arrival_time, priority,
                                            lora_request)

    def add_request(self, request_id: str, prompt: str | list[int] | Request,
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    priority: int = 0, lora_request: LoRARequest | str | None = None) -> None:
        """priority: with scheduling_policy="priority", lower values are served first.
        lora_request: an adapter of `lora_modules` or one added before (a LoRARequest or its
        name), or a new one: a LoRARequest with its `lora_path`."""
        req = prompt if isinstance(prompt, Request) else self.make_request(
            request_id, prompt, params, arrival_time, priority, lora_request)
        if req.request_id in self.requests:
            raise ValueError(f"Request id {req.request_id!r} is already in use.")
        seq = Sequence(req.request_id, req.prompt_token_ids, len(req.prompt_token_ids), req.params,
                       0, req.metrics.arrival_time, req.priority)
        if req.lora_name is not None:  # the scheduler gives it a slot when it runs
            seq.lora_name = req.lora_name
            seq.cache_salt = hash(("lora", req.lora_name))
        if req.params.structured_outputs is not None:  # compiled when the request was checked
            seq.grammar = Grammar(self.input_processor.structured.compile(req.params.structured_outputs))
        self._attach_detokenizer(seq, req)
        req.seqs.append(seq)
        self.requests[req.request_id] = req
        self.scheduler.add(seq)

    def _attach_detokenizer(self, seq: Sequence, req: Request) -> None:
        if not self.detokenize and not req.params.stop:
            return  # text is made by whoever reads the outputs
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                 req.params.skip_special_tokens,
                                                 req.params.spaces_between_special_tokens)

    def abort_request(self, request_id: str, error: str | None = None) -> RequestOutput | None:
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
        self._record_finished(req)
        return req.make_delta_output()

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
        if self.proposer is not None:
            # Proposals continue from the latest tokens, and a verified step's token count is
            # known only on arrival: take the step in flight first (no overlap of the two).
            # Beyond what a verification graph holds, the batch decodes plainly, pipelined.
            speculate = len(self.scheduler.running) <= self.max_speculating_seqs
            if self._inflight is not None and (speculate or self._inflight.spec):
                previous, self._inflight = self._inflight, None
                self._take_results(previous, outputs)
            if speculate:
                self._propose()
        defer = self._inflight is not None and self._must_sync()
        sched = self.scheduler.schedule()
        launched = None
        if not sched.is_empty:
            launched = self._launch(sched, outputs, defer)
        previous, self._inflight = self._inflight, launched
        if previous is not None:
            self._take_results(previous, outputs)
        if launched is not None and launched.deferred:
            self._sample_deferred(launched, outputs)
        outputs += self._process_text()
        if deliver is not None:
            deliver(outputs)
            return []
        return outputs

    def _propose(self) -> None:
        """Speculative decoding: proposed tokens for each running decode, at most what its length
        limits leave after one token (none before min_tokens)."""
        for seq in self.scheduler.running:
            seq.spec_token_ids = []
            p = seq.params
            if (seq.num_tokens - seq.num_computed_tokens != 1 or seq.num_unresolved or seq.finish_reason
                    or seq.num_output_tokens < p.min_tokens):
                continue
            room = self.max_seq_len - seq.num_tokens
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - seq.num_output_tokens)
            seq.spec_token_ids = self.proposer.propose(seq.token_ids, room - 1, seq.seq_id)
        self.proposer.retain({seq.seq_id for seq in self.scheduler.running})

    def _must_sync(self) -> bool:
        return any(s.params.needs_output_on_host for s in self.scheduler.running)

    def _sample_deferred(self, pending, outputs: list[RequestOutput]) -> None:
        try:
            self.runner.sample(pending)
        except Exception as exc:  # fail this batch's requests, keep serving the others
            logger.exception("model step failed")
            self._fail(pending.scheduled, f"internal error while running the model: {exc}", outputs)
            self._inflight = None

    def _launch(self, sched, outputs: list[RequestOutput], defer_sampling: bool = False):
        """Book the step as done (computed tokens, forks, a placeholder per sample, length
        limits), then queue it on the device (without its sampling when defer_sampling)."""
        rows: list[Sequence] = []
        sources: list[int] = []
        offsets: list[int] = []  # a sample row's distance back from its sequence's last new token
        drafts: list[int] = []  # the proposed token a sample row verifies, -1 for none
        spec: list[tuple[Sequence, list[int], int]] = []  # (sequence, its proposed tokens, first row)
        forks: list[tuple[Sequence, list[Sequence]]] = []
        prompt_spans = []  # (item, first, end): prompt tokens first..end-1 whose logprobs are asked
        for item in sched.scheduled:
            seq = item.seq
            if seq.needs_prompt_logprobs:
                # The rows of positions c..c+n-1 predict tokens c+1..c+n.
                c = seq.num_computed_tokens
                first = max(c + 1, seq.next_prompt_logprob)
                end = min(c + item.num_new_tokens + 1, seq.num_prompt_tokens)
                if first < end:
                    prompt_spans.append((item, first, end))
            if seq.spec_token_ids and item.num_new_tokens == len(seq.spec_token_ids) + 1:
                # Its last token and each proposed one: a row per position, verified on arrival.
                k = len(seq.spec_token_ids)
                spec.append((seq, seq.spec_token_ids, len(rows)))
                rows.extend([seq] * (k + 1))
                sources.extend([seq.seq_id] * (k + 1))
                offsets.extend(range(k, -1, -1))
                drafts.extend(seq.spec_token_ids + [-1])
                seq.token_ids.extend(seq.spec_token_ids)  # read by the step's inputs only
                continue
            if seq.num_computed_tokens + item.num_new_tokens < seq.num_tokens:
                continue  # a prompt chunk that does not reach the end: nothing to sample
            group = [seq]
            if seq.num_forks_pending:
                children = [seq.fork(i) for i in range(1, seq.params.n)]
                forks.append((seq, children))
                group += children
            rows.extend(group)
            sources.extend([seq.seq_id] * len(group))
            offsets.extend([0] * len(group))
            drafts.extend([-1] * len(group))
        for slot, name in sched.lora_loads:  # adapters taking a slot, before the step reads them
            self.runner.lora_manager.load(slot, name)
        try:
            pending = self.runner.launch(sched.scheduled, sched.block_copies, rows, sources,
                                         self._inflight, prompt_spans, defer_sampling,
                                         offsets if spec else None, drafts if spec else None)
        except Exception as exc:  # fail this batch's requests, keep serving the others
            logger.exception("model step failed")
            self._fail(sched, f"internal error while running the model: {exc}", outputs)
            return None
        finally:
            for seq, proposed, _ in spec:  # back to the known tokens; placeholders follow below
                del seq.token_ids[len(seq.token_ids) - len(proposed):]
        speculating = {seq.seq_id for seq, _, _ in spec}
        for item in sched.scheduled:
            item.seq.spec_token_ids = []
            if item.seq.seq_id in speculating:
                # Only its last token's keys and values count as computed until the proposed
                # ones are verified (`_verify`).
                item.num_new_tokens = 1
        pending.spec = spec
        for item, _, end in prompt_spans:
            item.seq.next_prompt_logprob = end
        self.scheduler.update_after_step(sched)
        for parent, children in forks:
            parent.num_forks_pending = 0
            req = self.requests[parent.request_id]
            for child in children:
                child.num_computed_tokens = parent.num_computed_tokens
                self.block_manager.fork(parent, child)
                self.scheduler.add_running(child)
                self._attach_detokenizer(child, req)
                req.seqs.append(child)
        pending.positions = []
        for seq in rows:
            seq.append_token(PLACEHOLDER)
            seq.num_unresolved += 1
            pending.positions.append(seq.num_tokens - 1)
            if seq.seq_id in speculating:
                continue  # how many of its rows become tokens is known on arrival (`_verify`)
            self._finish_at_length_limit(seq)  # known now: free its blocks, do not schedule it again
        pending.scheduled = sched
        return pending

    def _fail(self, sched, message: str, outputs: list[RequestOutput]) -> None:
        self.block_manager.reset_prefix_cache()
        for rid in {item.seq.request_id for item in sched.scheduled}:
            out = self.abort_request(rid, error=message)
            if out is not None:
                outputs.append(out)

    def _take_results(self, pending, outputs: list[RequestOutput]) -> None:
        """Wait for a launched step and put its sampled tokens in place of the placeholders."""
        try:
            results = pending.wait()
            self.device_wait_s += pending.waited_s
        except Exception as exc:
            logger.exception("model step failed")
            self._fail(pending.scheduled, f"internal error while running the model: {exc}", outputs)
            return
        for seq, first, prompt_results in pending.prompt_results:
            # In order: a prompt's chunks are taken in the order they were launched.
            if seq.request_id in self.requests and first == len(seq.prompt_logprobs):
                seq.prompt_logprobs.extend(make_logprobs_entry(r.token_id, r.logprob, r.rank, r.top)
                                           for r in prompt_results)
        if pending.spec:
            self._verify(pending, results)
        now = time.time()
        off_grammar: dict[str, int] = {}  # request id -> the token its grammar rejected
        for seq, pos, res in zip(pending.rows, pending.positions, results):
            req = self.requests.get(seq.request_id)
            if req is None or pos >= seq.num_tokens or seq.token_ids[pos] != PLACEHOLDER:
                continue  # aborted, or stopped at an earlier token: this one is past the end
            seq.token_ids[pos] = res.token_id
            seq.num_unresolved -= 1
            if seq.grammar is not None and not seq.grammar.accept(res.token_id):
                off_grammar.setdefault(req.request_id, res.token_id)
            self._record_token(seq, req, res, now)
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
            self._text_queue.append(seq)
        for seq, _, _ in pending.spec:  # length limits of speculating sequences, now known
            if seq.request_id in self.requests and not seq.is_finished:
                self._finish_at_length_limit(seq)
        for request_id, token in off_grammar.items():  # that request ends; the others carry on
            out = self.abort_request(request_id, error=f"structured_outputs: the grammar allows no "
                                                       f"continuation (sampled token {token}).")
            if out is not None:
                outputs.append(out)

    def _finish_at_length_limit(self, seq: Sequence) -> None:
        p = seq.params
        if (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or \
                seq.num_tokens >= self.max_seq_len:
            seq.finish_reason = "length"
            self.scheduler.finish(seq)

    def _verify(self, pending, results) -> None:
        """Speculative decoding: a sequence keeps its tokens up to the first that differs from
        the proposal, and that one (greedy rows took the argmax; sampled rows kept the proposal
        or drew from the rest, `_verify_drafts` in the sampler); the placeholders of the rest
        go, and the accepted proposals' keys and values count as computed."""
        for seq, proposed, first in pending.spec:
            if seq.request_id not in self.requests or seq.is_finished:
                continue
            accepted = 0
            while accepted < len(proposed) and results[first + accepted].token_id == proposed[accepted]:
                accepted += 1
            del seq.token_ids[pending.positions[first + accepted] + 1:pending.positions[first + len(proposed)] + 1]
            seq.num_unresolved -= len(proposed) - accepted
            seq.num_computed_tokens += accepted
            st = self.stats
            st.spec_decode_num_drafts += 1
            st.spec_decode_num_draft_tokens += len(proposed)
            st.spec_decode_num_accepted_tokens += accepted

    def _record_token(self, seq: Sequence, req: Request, res, now: float) -> None:
        if seq.params.logprobs is not None:
            seq.output_logprobs.append(make_logprobs_entry(res.token_id, res.logprob, res.rank, res.top))
        seq.cumulative_logprob += res.logprob
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            self.stats.time_to_first_token.append(now - m.arrival_time)
            self.stats.prompt_tokens += len(req.prompt_token_ids)
        if seq.index == 0:
            m.last_token_time = now
        self.stats.generation_tokens += 1

    def _process_text(self) -> list[RequestOutput]:
        """Detokenize new tokens, apply stop strings, build the outputs of touched requests."""
        queue, self._text_queue = self._text_queue, []
        touched: dict[str, Request] = {}
        for seq in queue:
            req = self.requests.get(seq.request_id)
            if req is None:
                continue  # aborted meanwhile
            touched[req.request_id] = req
            if seq.detokenizer is not None:
                self._detokenize(seq)
        outputs = []
        interval = self.args.stream_interval
        for req in touched.values():
            finished = req.finished
            if finished:
                self.requests.pop(req.request_id, None)
                self._record_finished(req)
            elif interval > 1 and req.holds_back(interval):
                continue  # its tokens go out with a later output
            out = req.make_delta_output(finished)
            if self.detokenize and (req.params.logprobs is not None or out.prompt_logprobs):
                fill_decoded_tokens(self.tokenizer, out.logprob_entries())
            outputs.append(out)
        return outputs

    def _detokenize(self, seq: Sequence) -> None:
        p = seq.params
        token_ids, first = seq.token_ids, seq.num_prompt_tokens
        known = len(token_ids) - first - seq.num_unresolved
        limit = known if seq.num_text_tokens is None else min(known, seq.num_text_tokens)
        while seq.num_detokenized < limit:
            delta = seq.detokenizer.add_token(token_ids[first + seq.num_detokenized])
            seq.num_detokenized += 1
            if not delta:
                continue
            seq.output_text += delta
            if p.stop and seq.num_detokenized >= p.min_tokens:
                hit = find_stop_string(seq.output_text, len(delta), p.stop)
                if hit is not None:
                    idx, stop = hit
                    seq.output_text = seq.output_text[:idx + len(stop) if p.include_stop_str_in_output else idx]
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    del seq.token_ids[seq.num_prompt_tokens + seq.num_detokenized:]
                    seq.num_unresolved = 0
                    if not seq.is_finished:
                        self.scheduler.finish(seq)  # safe with its next token in flight
                    return
        if seq.output_finished:
            seq.output_text += seq.detokenizer.flush()

    def _record_finished(self, req: Request) -> None:
        now = time.time()
        m, st = req.metrics, self.stats
        m.finished_time = now
        st.e2e_request_latency.append(now - m.arrival_time)
        n = req.seqs[0].num_output_tokens - req.seqs[0].num_unresolved
        if n > 1 and m.first_token_time is not None and m.last_token_time is not None:
            # One sample per request, its mean time per output token after the first (as
            # vLLM V1 does): per-token samples would cost a metrics call for every token.
            st.time_per_output_token.append((m.last_token_time - m.first_token_time) / (n - 1))
        reason = next((s.finish_reason for s in req.seqs if s.finish_reason), "abort")
        st.request_success[reason] = st.request_success.get(reason, 0) + 1
        # vLLM V1's per-request histograms (its FinishedRequestStats).
        p = req.params
        st.request_prompt_tokens.append(len(req.prompt_token_ids))
        st.request_generation_tokens.append(sum(s.num_output_tokens - s.num_unresolved for s in req.seqs))
        st.request_params_n.append(p.n)
        st.request_params_max_tokens.append(p.max_tokens if p.max_tokens is not None else self.args.max_model_len)
        m.first_scheduled_time = req.seqs[0].first_scheduled_time
        if m.first_scheduled_time is not None:
            st.request_queue_time.append(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                st.request_prefill_time.append(m.first_token_time - m.first_scheduled_time)
                last = m.last_token_time if m.last_token_time is not None else m.first_token_time
                st.request_decode_time.append(last - m.first_token_time)
                st.request_inference_time.append(last - m.first_scheduled_time)

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
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.block_manager.usage,
            prefix_cache_queries=self.block_manager.prefix_cache_queries,
            prefix_cache_hits=self.block_manager.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens, request_success=dict(s.request_success),
            spec_decode_num_drafts=s.spec_decode_num_drafts,
            spec_decode_num_draft_tokens=s.spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens=s.spec_decode_num_accepted_tokens,
            **self._lora_stats(), **{name: getattr(s, name) for name in EngineStats.SAMPLE_FIELDS})
        for name in EngineStats.SAMPLE_FIELDS:
            setattr(s, name, [])
        return snapshot
