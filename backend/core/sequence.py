"""Sequence: one stream of tokens (a prompt and one sample's output) and its scheduling state."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..outputs import Logprob
from ..step import PLACEHOLDER, SequenceStatus  # noqa: F401 (both: public here)

if TYPE_CHECKING:
    from ..sampling_params import SamplingParams


_seq_counter = itertools.count()


@dataclass
class RemotePrefill:
    """A consumer's request whose prompt another engine computed: the producer's id, its block
    ids holding the prompt, the prompt's length there, the producer's transfer metadata and the
    key it holds the blocks under. `first_block`..`end`: what this engine reads, set at
    admission (its own prefix-cache hit is not read again)."""
    engine_id: str
    block_ids: list[int]
    num_tokens: int
    metadata: str
    key: str
    first_block: int = 0
    end: int = 0  # tokens whose keys and values are read (the last prompt token is computed here)
    admitted: bool = False


class Sequence:
    """A prompt plus the tokens generated for it by one sample.

    `num_computed_tokens` counts the tokens whose K/V are in the cache; the scheduler moves it
    forward, preemption by recompute resets it to 0 (the sequence is recomputed, prompt and
    output alike); preemption by swap keeps it (its blocks wait in host memory).
    """

    def __init__(self, request_id: str, token_ids: list[int], num_prompt_tokens: int,
                 params: "SamplingParams", index: int = 0, arrival_time: float = 0.0,
                 priority: int = 0) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.index = index  # which of the request's n samples
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = num_prompt_tokens
        self.params = params
        self.arrival_time = arrival_time
        self.priority = priority  # (scheduling_policy="priority": lower is served first)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first admission
        self.first_scheduled_time: float | None = None  # wall clock of its first admission
        self.block_table: list[int] = []
        self.num_cached_blocks = 0  # leading blocks already offered to the prefix cache
        self.num_released_blocks = 0  # leading table positions given back (out of every layer's window)
        self.host_block_table: list[int] = []  # while SWAPPED: its computed blocks in host memory
        # A parent of n > 1 samples forks into n sequences after its prompt is computed.
        self.num_forks_pending = params.n - 1 if index == 0 else 0
        self.cumulative_logprob = 0.0
        self.output_logprobs: list[dict[int, Logprob]] = []
        # The prompt's logprobs when asked for: entry i is prompt token i's (None for the first,
        # which has nothing before it). Entries arrive with the steps that compute them.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None and index == 0 else None)
        # The next prompt position whose logprob no launched step computes yet: a prompt
        # recomputed after preemption does not compute them again.
        self.next_prompt_logprob = 1
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # The engine's per-sample output state, typed Any because the scheduling core imports
        # nothing of the engine: its IncrementalDetokenizer (engine/tokenizer.py) and, with
        # structured_outputs, its Grammar (engine/structured_output.py: where its output is in it).
        self.detokenizer: Any = None
        self.grammar: Any = None
        self.output_text = ""  # text after stop-string truncation
        self.num_detokenized = 0  # output tokens fed to the detokenizer
        self.num_text_tokens: int | None = None  # output tokens that have text (None: all)
        self.num_unresolved = 0  # trailing PLACEHOLDER tokens
        self.num_text_emitted = 0  # characters of output_text already streamed
        self.num_tokens_emitted = 0
        self.num_logprobs_emitted = 0
        # The LoRA adapter it runs with, its slot on the device while it runs (-1: none; the
        # scheduler assigns it), and, for the prefix cache, the root of its blocks' hash chain
        # (its adapter and cache_salt: block_hash.root_block_hash; None: neither) and its
        # prompt's block hashes when the input processor made them.
        self.lora_name: str | None = None
        self.lora_slot = -1
        self.block_hash_root: bytes | None = None
        self.prompt_block_hashes: list[bytes] = []
        # Disaggregated prefill: where its prompt's KV blocks are read from instead of computed.
        self.remote_prefill: RemotePrefill | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def output_finished(self) -> bool:
        """Finished, and every token it will report is known."""
        return self.finish_reason is not None and self.num_unresolved == 0

    def drop_unresolved(self) -> None:
        if self.num_unresolved:
            del self.token_ids[-self.num_unresolved:]
            self.num_unresolved = 0

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions whose logprobs are asked for and not yet computed."""
        return self.prompt_logprobs is not None and self.next_prompt_logprob < self.num_prompt_tokens

    @property
    def is_prefill(self) -> bool:
        """True until every known token (prompt, or prompt + output after preemption) is computed."""
        return self.num_computed_tokens < self.num_tokens - 1

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def add_placeholder(self) -> int:
        """A token a launched step samples; returns its position (filled in on arrival)."""
        self.token_ids.append(PLACEHOLDER)
        self.num_unresolved += 1
        return len(self.token_ids) - 1

    def fork(self, index: int) -> "Sequence":
        """A sibling sample sharing everything computed so far (the block manager shares blocks)."""
        child = Sequence(self.request_id, self.token_ids, self.num_prompt_tokens, self.params,
                         index, self.arrival_time, self.priority)
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.lora_name, child.block_hash_root = self.lora_name, self.block_hash_root  # its slot: add_running
        child.prompt_block_hashes = self.prompt_block_hashes
        if self.grammar is not None:
            child.grammar = self.grammar.fresh(self.token_ids[self.num_prompt_tokens:self.num_tokens - self.num_unresolved])
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, idx={self.index}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, {self.status.name})")
