"""Proposals from EAGLE-1 / EAGLE-3 heads (speculative_config method "eagle" / "eagle3").

As a draft model (draft_model.py), a head runs after every step with a paged
KV cache of its own on the target's block ids, but it reads the target's hidden states: row t
of its first pass pairs the target's hidden state at position t (EAGLE-3: three layers' inputs
through `fc`; EAGLE-1: the final normed state) with the token at t + 1, for every position the
target computed in the step, so its cache follows the target's exactly and the last row, with
the token just sampled, gives the first proposal. Each further pass feeds the head its own
output state and proposal at the next position (vLLM v1's chain of EAGLE drafts, greedy).
"""
from __future__ import annotations

import torch

from ..engine_config import EngineConfig
from ..models.eagle import EagleDraftHead
from ..models.loader import load_dummy
from ..worker.cuda_graph import SPEC_GRAPH_MAX_SEQS, HeadDecodeGraphs, HeadPrefillGraphs
from ..worker.input_batch import PreparedBatch
from ..worker.request_states import RequestState
from .draft_model import DraftModelProposer, DraftOut, DraftSpan
from .proposer import ModelProposer, TargetHidden


def make_proposer(config: EngineConfig, device: torch.device, target) -> ModelProposer:
    """The proposer the speculative config names (a draft model or EAGLE heads)."""
    if config.speculative_config.is_eagle:
        return EagleProposer(config, device, target)
    return DraftModelProposer(config, device, target)


class EagleProposer(DraftModelProposer):
    """An EAGLE head, its KV cache, its decode graphs, and the passes that propose."""

    reads_target_hidden = True

    def __init__(self, config: EngineConfig, device: torch.device, target) -> None:
        self._method = config.speculative_config.method  # (read by _build, from the base's __init__)
        super().__init__(config, device, target)

    def _build(self, draft_config, target) -> EagleDraftHead:
        spec_method = self._method
        with torch.device(self.device):
            if draft_config.load_format == "dummy":
                head = EagleDraftHead(spec_method, draft_config.hf_config, target.config, self.dtype,
                                      self.max_model_len)
                load_dummy(head, draft_config.seed + 1)
                # Random weights stand for a checkpoint of the head's own tensors: the embedding
                # (and EAGLE-1's LM head) come from the target, as from a head that lacks them.
                shared = {"embed_tokens.weight"} | ({"lm_head.weight"} if spec_method == "eagle" else set())
                head.own_weights = frozenset(n for n, _ in head.named_parameters() if n not in shared)
                head.share_target_weights(target)
            else:
                head = EagleDraftHead.from_pretrained(spec_method, draft_config.model, target, self.dtype,
                                                      self.max_model_len)
        head.eval()
        head.request_target_hidden_states(target)
        return head

    def build_graphs(self, capture: bool) -> None:
        """Graphs of the first pass (a few sequences' accepted rows, at most k + 1 each) and of
        the one-token passes."""
        max_blocks = -(-self.max_model_len // self.block_size)
        hidden_size = self.model.args.hidden_size
        seqs, chunk = min(self.max_num_seqs, SPEC_GRAPH_MAX_SEQS), self.k + 1
        self.prefill_graphs = HeadPrefillGraphs(self.model, hidden_size, self.dtype,
                                                min(seqs * chunk, self.max_num_batched_tokens), max_blocks,
                                                self.device, seqs, chunk, capture=capture, head=self.greedy)
        self.decode_graphs = HeadDecodeGraphs(self.model, hidden_size, self.dtype, self.max_num_seqs,
                                              max_blocks, self.max_model_len, self.device, capture=capture,
                                              head=self.greedy)
        if capture:
            self.prefill_graphs.capture()
            self.decode_graphs.capture()

    def _span_end(self, state: RequestState, computed: int) -> tuple[int, bool]:
        """The positions the target computed: their hidden states exist; the last one's token
        is the one just sampled (then it proposes) or the next prompt token."""
        return computed, len(state.token_ids) == computed + 1

    def _first_pass(self, spans: list[DraftSpan], target: TargetHidden | None) -> DraftOut:
        if target is None:
            raise RuntimeError("an EAGLE head needs the target's hidden states of the step")
        batch = self._chunks_batch(spans, shift=1)
        rows = [r for s in spans for r in range(target.first_row[s.state.seq_id],
                                                   target.first_row[s.state.seq_id] + s.end - s.start)]
        hidden = self.model.combine_hidden_states(target.hidden[self._index(rows)])
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(batch):
            carry, token_ids = self.prefill_graphs.run_with_hidden(batch, hidden)
            return DraftOut(token_ids, carry)
        last = self._index(batch.prefill_cu_seqlens_q[1:] - 1)
        carry, normed = self._eager(batch, self._to_device(batch.input_ids), hidden)
        return DraftOut(self.greedy(normed[last]), carry[last])

    def _decode(self, batch: PreparedBatch, fill, carry: torch.Tensor | None) -> DraftOut:
        if self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            carry, token_ids = self.decode_graphs.run_with_hidden(batch, fill, carry)
            return DraftOut(token_ids, carry)
        input_ids = self._to_device(batch.input_ids)
        input_ids[fill[0]] = fill[2][fill[1]]
        carry, normed = self._eager(batch, input_ids, carry)
        return DraftOut(self.greedy(normed), carry)

    def greedy(self, normed: torch.Tensor) -> torch.Tensor:
        """The head's argmax over its vocabulary, as target token ids."""
        return self.model.draft_to_target(self.model.compute_logits(normed).argmax(dim=-1))
