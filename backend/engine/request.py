"""Request: one client request (n samples), its timing, and how its new output is reported."""
from __future__ import annotations

from ..errors import RequestError
from ..outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ..sampling_params import SamplingParams
from ..core.sequence import Sequence
from .tokenizer import partial_stop_suffix_len


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float, priority: int = 0,
                 lora_name: str | None = None, deadline: float | None = None,
                 block_hashes: list[bytes] | None = None) -> None:
        self.request_id = request_id
        self.priority = priority  # with scheduling_policy="priority": lower values go first
        self.lora_name = lora_name  # its LoRA adapter (None: the base model)
        # Wall-clock time (time.time()) after which the engine ends it with an error, waiting
        # or running; None: no deadline.
        self.deadline = deadline
        # The prefix cache's hashes of the prompt's full blocks (empty: the engine makes them).
        self.block_hashes = block_hashes or []
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs: list[Sequence] = []
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.error: RequestError | None = None
        self.prompt_logprobs_sent = False
        # Disaggregated prefill: a producer's parameters for the consumer, sent when it finishes.
        self.kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:
            return seqs[0].output_finished
        return bool(seqs) and all(s.output_finished for s in seqs)

    def holds_back(self, stream_interval: int) -> bool:
        """Whether an unfinished request waits for more tokens before its next output: each of
        its samples has sent its first token, has fewer than stream_interval new ones, and has
        not just finished (a sample's finish goes out at once, as in vLLM, where each sample
        streams on its own)."""
        for seq in self.seqs:
            new = len(seq.token_ids) - seq.num_unresolved - seq.num_prompt_tokens - seq.num_tokens_emitted
            if seq.num_tokens_emitted == 0 or new >= stream_interval or (new and seq.output_finished):
                return False
        return True

    def make_delta_output(self, finished: bool | None = None) -> RequestOutput:
        """What is new since the previous call, per sample. Text that could be the start of a
        stop string is held back until it is known not to be one. `finished` saves recomputing
        `self.finished` when the caller has it."""
        if finished is None:
            finished = self.finished
        seqs = self.seqs if len(self.seqs) == 1 else sorted(self.seqs, key=_sample_index)
        completions = []
        for seq in seqs:
            text_end = len(seq.output_text)
            done = seq.output_finished
            params = seq.params
            if not done and params.stop:
                text_end -= partial_stop_suffix_len(seq.output_text, params.stop)
            text = ""
            if text_end > seq.num_text_emitted:
                text = seq.output_text[seq.num_text_emitted:text_end]
                seq.num_text_emitted = text_end
            start = seq.num_prompt_tokens + seq.num_tokens_emitted
            known = len(seq.token_ids) - seq.num_unresolved
            new_ids = seq.token_ids[start:known]
            seq.num_tokens_emitted += len(new_ids)
            logprobs = None
            if params.logprobs is not None:
                logprobs = seq.output_logprobs[seq.num_logprobs_emitted:]
                seq.num_logprobs_emitted = len(seq.output_logprobs)
            completions.append(CompletionOutput(
                seq.index, text, new_ids, seq.cumulative_logprob, logprobs,
                seq.finish_reason if done else None, seq.stop_reason if done else None))
        prompt_logprobs = None
        first = seqs[0]
        if (first.prompt_logprobs is not None and not self.prompt_logprobs_sent
                and len(first.prompt_logprobs) == first.num_prompt_tokens):
            prompt_logprobs, self.prompt_logprobs_sent = first.prompt_logprobs, True
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions,
                             finished, first.num_cached_tokens, self.error, self.metrics,
                             prompt_logprobs, self.kv_transfer_params if finished else None)


def _sample_index(seq: Sequence) -> int:
    return seq.index


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
    if delta.prompt_logprobs is not None:
        total.prompt_logprobs = delta.prompt_logprobs
    total.num_cached_tokens = delta.num_cached_tokens
    if delta.kv_transfer_params is not None:
        total.kv_transfer_params = delta.kv_transfer_params
    return total


def make_logprobs_entry(token_id: int, logprob: float, rank: int | None,
                        top: list[tuple[int, float]] | None) -> dict[int, Logprob]:
    entry = {tid: Logprob(lp, rank=r + 1) for r, (tid, lp) in enumerate(top or [])}
    entry[token_id] = Logprob(logprob, rank=rank)
    return entry
