"""What travels between an engine driver and its loop (`EngineCore`): typed commands in, typed
replies out. The process driver pickles them over its socket; the thread driver hands the
commands over in memory and receives the replies as calls (`CoreSink`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, Union

from ..engine_config import EngineLimits, ModelConfig
from ..errors import RequestError
from ..outputs import CompletionOutput, RequestOutput
from ..engine.metrics import EngineStats
from ..engine.request import Request


# ---- commands: driver -> core ------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request: Request  # validated and tokenized by the driver (InputProcessor)


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class GetStats:
    pass


@dataclass(frozen=True)
class CheckGrammar:
    """Compile a structured-output spec in the engine's process, before its request is taken."""
    token: int
    spec: dict[str, Any]


@dataclass(frozen=True)
class Shutdown:
    pass


Command = Union[AddRequest, AbortRequest, GetStats, CheckGrammar, Shutdown]


# ---- replies: core -> driver -------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """The engine is built. Only what the parent cannot know itself comes back: the model's
    part of the configuration (resolved against the model) and the built engine's limits; the
    parent resolves the rest from the EngineArgs it sent (EngineArgs.create_engine_config)."""
    model_config: ModelConfig
    limits: EngineLimits


@dataclass(frozen=True)
class StartupFailed:
    message: str


@dataclass(frozen=True)
class Outputs:
    """One or more steps' outputs, in order."""
    outputs: list["TokenDelta | TokenRun | PackedOutput"] = field(default_factory=list)


@dataclass(frozen=True)
class StatsReply:
    stats: EngineStats


@dataclass(frozen=True)
class GrammarChecked:
    token: int
    error: str | None  # None: the spec compiles (else the driver refuses the request: INVALID_ARGUMENT)


@dataclass(frozen=True)
class Bye:
    pass


Reply = Union[Ready, StartupFailed, Outputs, StatsReply, GrammarChecked, Bye]


class CoreSink(Protocol):
    """Where an engine core's replies go (the thread driver itself, or the process's Outbox)."""

    def outputs(self, outputs: list[RequestOutput]) -> None: ...

    def stats(self, stats: EngineStats) -> None: ...


# ---- outputs on the wire -------------------------------------------------------------------------
class TokenDelta(NamedTuple):
    """The common output: one new token of a request's only sample, nothing else to say (no
    text, logprobs or end). Named tuples pickle at a fraction of a dataclass's cost."""
    request_id: str
    token_id: int
    cumulative_logprob: float | None
    num_cached_tokens: int


class TokenRun(NamedTuple):
    """Several TokenDeltas of one request folded together (`fold_token_deltas`): what a
    message that carries several steps holds for each request that only decoded in them."""
    request_id: str
    token_ids: list[int]
    cumulative_logprob: float | None
    num_cached_tokens: int


class PackedCompletion(NamedTuple):
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: Any
    finish_reason: str | None
    stop_reason: int | str | None


class PackedOutput(NamedTuple):
    """Any other output, without the prompt (the driver has it)."""
    request_id: str
    finished: bool
    error: RequestError | None  # travels with its kind and parameter (it pickles whole)
    num_cached_tokens: int
    completions: list[PackedCompletion]
    prompt_logprobs: Any
    kv_transfer_params: dict | None = None


@dataclass
class EngineOutput:
    """An output as the driver rebuilds it (it adds the prompt and the request's metrics)."""
    request_id: str
    finished: bool
    error: RequestError | None
    num_cached_tokens: int
    completions: list[CompletionOutput]
    prompt_logprobs: Any = None
    kv_transfer_params: dict | None = None


def error_output(req: Request, error: RequestError) -> RequestOutput:
    """The final output of a request the engine loop did not run to its end (refused, shut
    down, the engine gone): one aborted sample without tokens, and the error."""
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids,
                         [CompletionOutput(0, "", [], None, None, "abort")], True, error=error,
                         metrics=req.metrics)


def pack_output(out: RequestOutput) -> TokenDelta | PackedOutput:
    completions = out.outputs
    if len(completions) == 1 and not out.finished and out.error is None and out.prompt_logprobs is None:
        c = completions[0]
        if (c.index == 0 and len(c.token_ids) == 1 and not c.text and c.logprobs is None
                and c.finish_reason is None):
            return TokenDelta(out.request_id, c.token_ids[0], c.cumulative_logprob, out.num_cached_tokens)
    return PackedOutput(out.request_id, out.finished, out.error, out.num_cached_tokens,
                        [PackedCompletion(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs,
                                          c.finish_reason, c.stop_reason) for c in completions],
                        out.prompt_logprobs, out.kv_transfer_params)


def fold_token_deltas(packed: list[TokenDelta | TokenRun | PackedOutput]) -> list[TokenDelta | TokenRun | PackedOutput]:
    """Several steps' outputs -> each request's TokenDeltas that follow one another (no other
    output of it between them) as one TokenRun, at the place of the first: a message then
    costs both sides per request, not per token, however many steps it carries (the parent
    reads slowly exactly when many queue). Every request's outputs keep their order."""
    out: list[TokenDelta | TokenRun | PackedOutput] = []
    runs: dict[str, int] = {}  # request id -> index in `out` of its open run
    for p in packed:
        if type(p) is TokenDelta:
            i = runs.get(p.request_id)
            if i is not None:
                prev = out[i]
                ids = prev.token_ids if type(prev) is TokenRun else [prev.token_id]
                ids.append(p.token_id)
                out[i] = TokenRun(p.request_id, ids, p.cumulative_logprob, p.num_cached_tokens)
                continue
            runs[p.request_id] = len(out)
        else:
            runs.pop(p.request_id, None)
        out.append(p)
    return out


def token_completions(packed: TokenDelta | TokenRun) -> list[CompletionOutput]:
    """The one sample's new tokens that a TokenDelta or a TokenRun carries."""
    token_ids = [packed.token_id] if type(packed) is TokenDelta else packed.token_ids
    return [CompletionOutput(0, "", token_ids, packed.cumulative_logprob, None)]


def unpack_output(packed: TokenDelta | TokenRun | PackedOutput) -> EngineOutput:
    if isinstance(packed, (TokenDelta, TokenRun)):
        return EngineOutput(packed.request_id, False, None, packed.num_cached_tokens, token_completions(packed))
    return EngineOutput(packed.request_id, packed.finished, packed.error, packed.num_cached_tokens,
                        [CompletionOutput(*c) for c in packed.completions], packed.prompt_logprobs,
                        packed.kv_transfer_params)
