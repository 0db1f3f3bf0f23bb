"""What the engine returns: vLLM's RequestOutput / CompletionOutput shapes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import RequestError


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per generated token: token id -> Logprob (the sampled token and the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing comes before it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of the n samples of a request.

    From `LLM.generate` the fields hold the whole completion; from the streaming engine's callback
    `token_ids`, `text` and `logprobs` hold only what is new since the previous callback.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: RequestError | None = None  # set when the engine failed or dropped the request
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # One entry per prompt token (None for the first) when prompt_logprobs was asked for; a
    # streamed request gets them once, in the output with its first token.
    prompt_logprobs: PromptLogprobs | None = None
    # Disaggregated prefill: what a producer returns for the consumer (vLLM's field).
    kv_transfer_params: dict[str, Any] | None = None

    def logprob_entries(self) -> list[dict[int, Logprob] | None]:
        """Every logprob entry of this output: the prompt's, then each sample's."""
        return (self.prompt_logprobs or []) + [e for c in self.outputs for e in c.logprobs or ()]


OutputCallback = Callable[[RequestOutput], None]
