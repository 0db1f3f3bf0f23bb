"""Request: one client request (n samples), its timing, and how its new output is reported."""
from __future__ import annotations

from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .sequence import Sequence
from .tokenizer import partial_stop_suffix_len


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs: list[Sequence] = []
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return bool(self.seqs) and all(s.output_finished for s in self.seqs)

    def make_delta_output(self) -> RequestOutput:
        """What is new since the previous call, per sample. Text that could be the start of a
        stop string is held back until it is known not to be one."""
        completions = []
        for seq in sorted(self.seqs, key=lambda s: s.index):
            text_end = len(seq.output_text)
            done = seq.output_finished
            if not done and seq.params.stop:
                text_end -= partial_stop_suffix_len(seq.output_text, seq.params.stop)
            text = seq.output_text[seq.num_text_emitted:text_end]
            seq.num_text_emitted = max(seq.num_text_emitted, text_end)
            known = seq.num_tokens - seq.num_unresolved
            new_ids = seq.token_ids[seq.num_prompt_tokens + seq.num_tokens_emitted:known]
            seq.num_tokens_emitted += len(new_ids)
            logprobs = None
            if seq.params.logprobs is not None:
                logprobs = seq.output_logprobs[seq.num_logprobs_emitted:]
                seq.num_logprobs_emitted = len(seq.output_logprobs)
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=new_ids,
                cumulative_logprob=seq.cumulative_logprob, logprobs=logprobs,
                finish_reason=seq.finish_reason if done else None,
                stop_reason=seq.stop_reason if done else None))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions,
                             finished=self.finished, num_cached_tokens=self.seqs[0].num_cached_tokens,
                             error=self.error, metrics=self.metrics)


def accumulate(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Fold a delta output into the running total (what `LLM.generate` returns)."""
    if total is None:
        total = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids, [], False,
                              metrics=delta.metrics)
    by_index = {c.index: c for c in total.outputs}
    for c in delta.outputs:
        acc = by_index.get(c.index)
        if acc is None:
            acc = CompletionOutput(c.index, "", [], None, [] if c.logprobs is not None else None)
            by_index[c.index] = acc
        acc.text += c.text
        acc.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            acc.logprobs = (acc.logprobs or []) + c.logprobs
        acc.cumulative_logprob = c.cumulative_logprob
        acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason
    total.outputs = [by_index[i] for i in sorted(by_index)]
    total.finished = delta.finished
    total.error = delta.error
    total.num_cached_tokens = delta.num_cached_tokens
    return total


def make_logprobs_entry(token_id: int, logprob: float, rank: int | None,
                        top: list[tuple[int, float]] | None) -> dict[int, Logprob]:
    entry = {tid: Logprob(lp, rank=r + 1) for r, (tid, lp) in enumerate(top or [])}
    entry[token_id] = Logprob(logprob, rank=rank)
    return entry
