"""OutputDetokenizer: text for the outputs the engine process sends as token ids."""
from __future__ import annotations

from ..outputs import CompletionOutput
from .tokenizer import IncrementalDetokenizer


class OutputDetokenizer:
    """Text for one request's outputs, made in the parent from the token ids the engine process
    sends (it detokenizes only requests with stop strings): the step loop does not wait for it.
    Same rules as the engine's own detokenization: a token that stops the sequence has no text,
    and what an incomplete character held back comes out with the final output."""

    def __init__(self, tokenizer, req) -> None:
        self._tokenizer = tokenizer
        self._req = req
        self._samples: dict[int, IncrementalDetokenizer] = {}

    def _sample(self, index: int) -> IncrementalDetokenizer:
        det = self._samples.get(index)
        if det is None:
            p = self._req.params
            det = self._samples[index] = IncrementalDetokenizer(
                self._tokenizer, self._req.prompt_token_ids, p.skip_special_tokens,
                p.spaces_between_special_tokens)
        return det

    def batchable(self, outputs: list[CompletionOutput]) -> IncrementalDetokenizer | None:
        """The detokenizer of the common output (one sample, new tokens, not the last), whose
        text `detokenize_many` makes together with other streams'; else None."""
        if len(outputs) == 1 and outputs[0].finish_reason is None and outputs[0].token_ids:
            return self._sample(outputs[0].index)
        return None

    def fill(self, outputs: list[CompletionOutput]) -> None:
        for c in outputs:
            det = self._sample(c.index)
            ids = c.token_ids
            if c.finish_reason is None:  # (one sample's go through batchable instead)
                c.text = "".join([det.add_token(t) for t in ids])
                continue
            if c.finish_reason == "stop" and not isinstance(c.stop_reason, str) and ids:
                ids = ids[:-1]  # the stop token
            c.text = "".join([det.add_token(t) for t in ids]) + det.flush()
