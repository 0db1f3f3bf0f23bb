"""OutputProcessor: arrived tokens -> text, stop strings, metrics and delta RequestOutputs."""
from __future__ import annotations

import time

from ..engine_config import SchedulerConfig
from ..outputs import RequestOutput
from .metrics import EngineStats
from .request import Request, make_logprobs_entry
from ..core.scheduler import Scheduler
from ..core.sequence import Sequence
from .tokenizer import IncrementalDetokenizer, fill_decoded_tokens, find_stop_string


class OutputProcessor:
    """Owns what happens to a token once its step's results arrive, after the engine has put
    it in its sequence: logprobs and latency records, detokenization (a stop string ends the
    sequence), and each touched request's delta output.

    With `detokenize=False` the outputs of requests without stop strings carry token ids and
    no text: the engine process's parent makes it (`engine_process.OutputDetokenizer`), in
    parallel with the step loop."""

    def __init__(self, scheduler_config: SchedulerConfig, max_model_len: int, tokenizer, scheduler: Scheduler,
                 stats: EngineStats, detokenize: bool = True) -> None:
        self.stream_interval = scheduler_config.stream_interval
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.stats = stats
        self.detokenize = detokenize
        self._text_queue: list[Sequence] = []  # sequences with tokens not yet turned into text

    def attach_detokenizer(self, seq: Sequence, req: Request) -> None:
        if not self.detokenize and not req.params.stop:
            return  # text is made by whoever reads the outputs
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                 req.params.skip_special_tokens,
                                                 req.params.spaces_between_special_tokens)

    def record_token(self, seq: Sequence, req: Request, res, now: float) -> None:
        """A token arrived in `seq`: its logprobs and the request's timing."""
        if seq.params.logprobs is not None:
            seq.output_logprobs.append(make_logprobs_entry(res.token_id, res.logprob, res.rank, res.top))
        seq.cumulative_logprob += res.logprob
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            self.stats.time_to_first_token.append(now - m.arrival_time)
            self.stats.prompt_tokens += len(req.prompt_token_ids)
        if seq.index == 0:
            # vLLM's inter-token latency: one sample per step that brings the request new
            # tokens after its first (a step's several speculative tokens are one sample).
            if m.last_token_time is not None and now > m.last_token_time:
                self.stats.time_per_output_token.append(now - m.last_token_time)
            m.last_token_time = now
        self.stats.generation_tokens += 1
        self._text_queue.append(seq)

    def process(self, requests: dict[str, Request]) -> list[RequestOutput]:
        """Detokenize new tokens, apply stop strings, build the outputs of touched requests; a
        finished request leaves `requests`."""
        queue, self._text_queue = self._text_queue, []
        touched: dict[str, Request] = {}
        for seq in queue:
            req = requests.get(seq.request_id)
            if req is None:
                continue  # aborted meanwhile
            touched[req.request_id] = req
            if seq.detokenizer is not None:
                self._detokenize(seq)
        outputs = []
        interval = self.stream_interval
        for req in touched.values():
            finished = req.finished
            if finished:
                requests.pop(req.request_id, None)
                self.record_finished(req)
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

    def record_finished(self, req: Request) -> None:
        """The request's end in the statistics (vLLM V1's per-request histograms)."""
        now = time.time()
        m, st = req.metrics, self.stats
        m.finished_time = now
        st.e2e_request_latency.append(now - m.arrival_time)
        reason = next((s.finish_reason for s in req.seqs if s.finish_reason), "abort")
        st.request_success[reason] = st.request_success.get(reason, 0) + 1
        p = req.params
        st.request_prompt_tokens.append(len(req.prompt_token_ids))
        st.request_generation_tokens.append(sum(s.num_output_tokens - s.num_unresolved for s in req.seqs))
        st.request_params_n.append(p.n)
        st.request_params_max_tokens.append(p.max_tokens if p.max_tokens is not None else self.max_model_len)
        m.first_scheduled_time = req.seqs[0].first_scheduled_time if req.seqs else None
        if m.first_scheduled_time is not None:
            st.request_queue_time.append(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                st.request_prefill_time.append(m.first_token_time - m.first_scheduled_time)
                last = m.last_token_time if m.last_token_time is not None else m.first_token_time
                st.request_decode_time.append(last - m.first_token_time)
                st.request_inference_time.append(last - m.first_scheduled_time)
