"""The pipelined step of LLMEngine: schedule and launch step N+1 while step N runs, then take
N's tokens (placeholders filled, proposals verified, stops and length limits found) and turn them
into outputs. A model failure fails the batch's requests and the engine serves on."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from ..core.block_manager import BlockManager
from ..core.scheduler import Scheduler
from ..core.scheduler_output import SchedulerOutput
from ..core.sequence import PLACEHOLDER, Sequence
from ..errors import ErrorKind, RequestError
from ..outputs import RequestOutput
from ..spec_decode.metrics import record_verification
from ..spec_decode.proposer import TokenProposer, gather_proposals
from ..spec_decode.verification import num_accepted
from ..step import SampleResult
from ..worker.executor import Executor
from ..worker.pending_step import PendingStep
from .kv_connector import KVConnector
from .metrics import EngineStats
from .output_processor import OutputProcessor
from .request import Request, make_logprobs_entry
from .request_intake import Deadlines
from .structured_output import grammar_bitmask

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


class StepPipeline:
    """LLMEngine's `step` and its parts, mixed into LLMEngine, which builds what they use (below).
    The parts are methods of the engine so that a subclass or a benchmark can wrap them
    (`_propose`, `_launch`, `_take_results`, `_verify`, `_sample_deferred`)."""

    # Built by LLMEngine.
    scheduler: Scheduler
    block_manager: BlockManager
    executor: Executor
    output_processor: OutputProcessor
    requests: dict[str, Request]
    stats: EngineStats
    proposer: TokenProposer | None
    drafts_in_worker: bool
    max_speculating_seqs: int
    max_seq_len: int
    vocab_size: int
    kv_connector: KVConnector | None
    kv_failures: list[RequestOutput]  # requests a failed KV read ended
    # The step's own state, set up by LLMEngine.__init__.
    _inflight: InflightStep | None
    _draft_token_ids: dict[int, list[int]]
    _tokens_counted: int
    device_wait_s: float
    # Of the request intake (RequestIntake).
    _deadlines: Deadlines
    _expire: Callable[[list[RequestOutput]], None]
    abort_request: Callable[..., RequestOutput | None]

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
        if self.kv_connector is not None:
            self.kv_connector.poll()
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
        if self.kv_connector is not None:
            self.kv_connector.start_reads()
            outputs += self.kv_failures
            self.kv_failures.clear()
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



def _model_failed(exc: Exception) -> RequestError:
    return RequestError(f"internal error while running the model: {exc}", ErrorKind.INTERNAL)
