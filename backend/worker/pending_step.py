"""A launched step, whose `wait()` gives its typed result (`ModelRunnerOutput`, backend/step.py)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..layers.sampler import PromptLogprobsOutput, SamplerOutput
from ..spec_decode.verification import num_accepted
from ..step import (PLACEHOLDER, GrammarBitmask, ModelRunnerOutput, PromptLogprobsResult, SampleResult,
                    SchedulerOutput)


@dataclass(frozen=True)
class PromptSpanTokens:
    """A prompt span as the worker read it from its state: the tokens whose logprobs the step
    computes, from position `first`, and how many top logprobs each reports."""
    seq_id: int
    first: int
    token_ids: list[int]
    num_logprobs: int


class PendingStep:
    """A launched step, owned by the runner. The sampled tokens stay on the device (the next
    step reads them there) and travel to pinned host memory without blocking; `wait()` blocks
    on a CUDA event, which releases the GIL so that other threads (the server's response
    sender) run meanwhile."""

    def __init__(self, step: SchedulerOutput, spans: list[PromptSpanTokens] = (),
                 prompt: PromptLogprobsOutput | None = None) -> None:
        self.step = step
        self.spans = list(spans)
        self.seq_ids = [row.seq_id for row in step.sample_rows]  # each sample row's sequence
        self.row_of = {seq_id: i for i, seq_id in enumerate(self.seq_ids)}
        self.waited_s = 0.0  # how long wait() blocked on the device
        # The sampling of a deferred step: queued by sample() once the host knows what it reads.
        self._deferred: Callable[[GrammarBitmask | None], SamplerOutput] | None = None
        self._prompt = prompt
        self.event = None
        self.token_ids: torch.Tensor | None = None  # on the device: the next step reads them
        self.host = self.prompt_host = None
        self.has_ranks = False
        self.num_logprobs = None  # per row, the top logprobs asked for (-1: none); None: no row asks
        # The worker's states to complete on arrival (`RequestState`s, backend/worker/
        # request_states.py): per sample row, (state, position of its placeholder) or None for a
        # verification row; and each verification run's state.
        self.placeholders: list[tuple[Any, int] | None] = []
        self.spec_states: list[Any] = []
        # Speculative decoding with a draft model: the proposals for the next step, made once
        # this step's tokens are in the worker's states (`ModelProposer.propose`, backend/spec_decode).
        self.propose: Callable[[], dict[int, list[int]]] | None = None

    @property
    def deferred(self) -> bool:
        return self._deferred is not None

    def defer(self, sample: Callable[[GrammarBitmask | None], SamplerOutput]) -> None:
        self._deferred = sample

    def sample(self, grammar: GrammarBitmask | None = None) -> None:
        """Queue the deferred sampling (the previous step's tokens are on the host now), with
        the guided rows' masks made from them."""
        sample, self._deferred = self._deferred, None
        self.finish(sample(grammar))

    def finish(self, out: SamplerOutput | None) -> None:
        """Start the copies of the sampled tokens (and prompt logprobs) to the host."""
        prompt, self._prompt = self._prompt, None
        self.token_ids = out.token_ids if out is not None else None
        on_device = []
        if out is not None:
            packed = [out.token_ids.double(), out.logprobs.double()]
            if out.ranks is not None:
                packed.append(out.ranks.double())
            self.host = [torch.stack(packed)] + [t for t in (out.top_logprobs, out.top_token_ids) if t is not None]
            self.has_ranks = out.ranks is not None
            self.num_logprobs = out.num_logprobs
            on_device.append(self.host)
        if prompt is not None:
            self.prompt_host = [torch.stack([prompt.token_logprobs.double(), prompt.ranks.double()])]
            if prompt.top_logprobs is not None:
                self.prompt_host += [prompt.top_logprobs, prompt.top_token_ids]
            on_device.append(self.prompt_host)
        if on_device and on_device[0][0].is_cuda:
            for tensors in on_device:
                tensors[:] = [t.to("cpu", non_blocking=True) for t in tensors]
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> ModelRunnerOutput:
        out = self._results()
        if self.propose is not None:
            out.draft_token_ids = self.propose()
        return out

    def _results(self) -> ModelRunnerOutput:
        if self.event is not None:
            start = time.perf_counter()
            self.event.synchronize()
            self.waited_s = time.perf_counter() - start
        out = ModelRunnerOutput()
        if self.prompt_host is not None:
            out.prompt_logprobs = self._prompt_logprobs()
        if self.host is None:
            return out
        main = self.host[0].tolist()
        token_ids, logprobs = main[0], main[1]
        ranks = main[2] if self.has_ranks else None
        top_vals = self.host[1].tolist() if len(self.host) > 1 else None
        top_ids = self.host[2].tolist() if len(self.host) > 2 else None
        asked = self.num_logprobs.tolist() if self.num_logprobs is not None else [-1] * len(self.seq_ids)
        for i, (seq_id, k) in enumerate(zip(self.seq_ids, asked)):
            top = None
            if k >= 0:
                top = list(zip(top_ids[i][:k], top_vals[i][:k])) if k and top_ids else []
            out.sampled.setdefault(seq_id, []).append(
                SampleResult(int(token_ids[i]), logprobs[i], top, int(ranks[i]) if k >= 0 else None))
        self._complete_states(out)
        return out

    def _complete_states(self, out: ModelRunnerOutput) -> None:
        """The worker's host tokens from the results: each placeholder filled in; a verification
        run keeps its tokens up to the first that differs from its proposal, and that one (the
        engine's rule), its accepted proposals counted as computed."""
        for entry, seq_id in zip(self.placeholders, self.seq_ids):
            if entry is not None:
                state, pos = entry
                if pos < len(state.token_ids) and state.token_ids[pos] == PLACEHOLDER:
                    state.token_ids[pos] = out.sampled[seq_id][0].token_id  # its one row
        for run, state in zip(self.step.spec_runs, self.spec_states):
            results = out.sampled[run.seq_id]
            accepted = num_accepted(results, run.proposed)
            state.token_ids.extend(r.token_id for r in results[:accepted + 1])
            state.num_computed_tokens += accepted

    def _prompt_logprobs(self) -> dict[int, PromptLogprobsResult]:
        main = self.prompt_host[0].tolist()
        top_vals = self.prompt_host[1].tolist() if len(self.prompt_host) > 1 else None
        top_ids = self.prompt_host[2].tolist() if len(self.prompt_host) > 1 else None
        row, out = 0, {}
        for span in self.spans:
            k = span.num_logprobs
            results = []
            for token_id in span.token_ids:
                top = list(zip(top_ids[row][:k], top_vals[row][:k])) if k else None
                results.append(SampleResult(token_id, main[0][row], top, int(main[1][row])))
                row += 1
            out[span.seq_id] = PromptLogprobsResult(span.first, results)
        return out
