"""Worker-side inputs built by hand for tests: the worker's state of a sequence
(`RequestState`) and a packed batch of such states, without a scheduler."""
from __future__ import annotations

from tritium.sampling_params import SamplingParams
from tritium.step import ScheduledSequence
from tritium.worker.input_batch import PreparedBatch, prepare_batch
from tritium.worker.request_states import RequestState


def make_state(seq_id: int, token_ids: list[int], block_table: list[int], num_computed_tokens: int = 0,
               params: SamplingParams | None = None, num_prompt_tokens: int | None = None,
               index: int = 0, lora_slot: int = -1) -> RequestState:
    return RequestState(seq_id, index, list(token_ids),
                        len(token_ids) if num_prompt_tokens is None else num_prompt_tokens,
                        params or SamplingParams(), list(block_table), num_computed_tokens, lora_slot)


def pack(items: list[tuple[RequestState, int]], block_size: int, **kwargs) -> PreparedBatch:
    """prepare_batch over (state, new tokens this step) pairs, in that order."""
    scheduled = [ScheduledSequence(s.seq_id, n) for s, n in items]
    return prepare_batch(scheduled, {s.seq_id: s for s, _ in items}, block_size, **kwargs)
