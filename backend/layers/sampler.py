"""Sampler: allowed ids, bad words, logit bias, penalties, temperature, min-p, top-k, top-p,
seeded sampling and logprobs.

Works on a [num_rows, vocab] float32 logits tensor; each row comes with an object carrying
`seq_id`, `params` (SamplingParams), `token_ids`, `num_prompt_tokens` and `index` (in the
engine, the worker's `RequestState`, backend/worker/request_states.py); guided rows' grammar
masks come made by the engine (`GrammarBitmask`). A row's parameters are read from its
sequence's slot of a `SamplingTable` (backend/layers/sampling_table.py), written once when the
worker takes the sequence in. Rows with a seed draw from a generator seeded afresh for each token from
(seed, sample index, token position), so their tokens depend neither on whatever else is in
the batch nor on how many positions a step samples (speculative decoding). Order of
processing, as in vLLM: allowed_token_ids, bad_words, logit_bias, penalties, min_tokens,
temperature, min_p, top_k, top_p, then sampling
by the exponential race (argmax of p / E with E ~ Exp(1), which draws from p). Logprobs are of
the model's raw distribution.

Everything the sampler needs from the host is copied to the device by `prepare()`, before the
model's forward is queued: a host-to-device copy after it would wait for the whole forward.
Penalties read token counts kept on the device (`PenaltyCounts`, backend/layers/penalties.py),
to which the sampler adds the tokens it samples, so their host work does not grow with the
sequences' lengths and needs none of the previous step's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence as Seq

import numpy as np
import torch

from tritium import kernels

from ..spec_decode import verification
from ..step import GrammarBitmask
from .penalties import PenaltyCounts, PenaltyRows, apply_penalties
from .sampling_metadata import SamplerOutput, SamplingMetadata, host_to_device, TokenPairs
from .sampling_table import SamplingTable


class Sampler:
    def __init__(self, counts: PenaltyCounts | None = None, table: SamplingTable | None = None) -> None:
        """counts: the engine's penalty counts (a slot per running sequence with a penalty);
        without, each call counts its rows' tokens from the host. table: the engine's sampling
        parameters per running sequence (`prepare(table=...)`)."""
        self.counts = counts
        self.table = table

    @staticmethod
    def prepare(rows: Seq[Any], vocab_size: int, device: torch.device,
                pending_tokens: int = 0, counts: PenaltyCounts | None = None,
                drafts: Seq[int] | None = None, table: SamplingTable | None = None,
                proposals: dict[int, list[int]] | None = None,
                grammar: GrammarBitmask | None = None) -> SamplingMetadata:
        """pending_tokens: each row's last tokens that are this step's own placeholders (a
        deferred sampling's rows already hold them), left out of bad words and min_tokens.
        counts: the engine's penalty counts (`Sampler.counts`); the sampling adds its tokens.
        drafts: per row, the proposed token it verifies (speculative decoding), -1 for none.
        table: the engine's per-sequence parameters (`Sampler.table`): a row's parameters are
        read from its slot there, written when its sequence was added (`SamplingTable.add`);
        without, a table is made for this call. proposals: the tokens each speculating sequence (by
        seq_id) proposes; its verification rows see them after its tokens: a row's bad words,
        penalties and seeded draw read the tokens before its position. grammar: the guided
        rows' masks (made by the engine from its grammars)."""
        if proposals:
            views = {seq_id: verification.WithProposals(r, proposals[seq_id]) for r in rows
                     if (seq_id := r.seq_id) in proposals}
            rows = [views.get(r.seq_id, r) for r in rows]
        if table is None:
            table, slots = SamplingTable.transient(rows, vocab_size, device)
        else:
            slots = table.slots_for(rows)
        flag = {name: column[slots] for name, column in table.flags.items()}
        run_start, ahead = verification.verification_runs(rows, drafts)
        logprobs = table.logprobs[slots]
        md = SamplingMetadata(all_greedy=bool(flag["greedy"].all()))
        md.want_logprobs = bool((logprobs >= 0).any())
        md.row_logprobs = logprobs
        md.max_logprobs = int(logprobs.max(initial=0))
        slots_on_device = None
        if not md.all_greedy or flag["has_penalties"].any():
            slots_on_device = host_to_device(slots, None, device)
        if not md.all_greedy:
            md.greedy = table.greedy[slots_on_device]
            md.temperature = table.temperature[slots_on_device]
            if flag["has_min_p"].any():
                md.min_p = table.min_p[slots_on_device]
            if flag["has_top_k"].any():
                md.top_k = table.top_k[slots_on_device]
            if flag["has_top_p"].any():
                md.top_p = table.top_p[slots_on_device]
            md.generator = table.generator
            md.seeded = [(int(i), table.seed[slots[i]], table.index[slots[i]],
                          len(rows[i].token_ids) - pending_tokens - ahead[i]) for i in np.flatnonzero(flag["has_seed"])]
            # Rejection sampling for unseeded sampled rows; a seeded row draws its token as without
            # proposals and keeps a proposal it equals (for a proposed token, the same chance p(d)).
            if drafts is not None:
                verified = np.where(~flag["greedy"] & ~flag["has_seed"], np.asarray(drafts, dtype=np.int64), -1)
                if (verified >= 0).any():
                    md.drafts = host_to_device(verified, None, device)
        if grammar is not None:
            md.grammar_rows = host_to_device(grammar.rows, torch.int64, device)
            bitmask = grammar.bitmask
            md.grammar_bitmask = bitmask if device.type != "cuda" else bitmask.pin_memory().to(device, non_blocking=True)
        allowed, banned, bias, min_tokens = TokenPairs(), TokenPairs(), TokenPairs(1), TokenPairs()
        cleared = []  # rows with allowed_token_ids
        for i in np.flatnonzero(flag["has_adjustments"]).tolist():
            r, p = rows[i], table.params[slots[i]]
            cut = pending_tokens + ahead[i]
            tokens = r.token_ids[:len(r.token_ids) - cut] if cut else r.token_ids
            if p.allowed_token_ids is not None:
                allowed.add(i, set(p.allowed_token_ids))
                cleared.append(i)
            if p._bad_words_token_ids:
                banned.add(i, _banned_by_bad_words(p._bad_words_token_ids, tokens[r.num_prompt_tokens:]))
            if p.logit_bias:
                bias.add(i, p.logit_bias, list(p.logit_bias.values()))
            if p.min_tokens and len(tokens) - r.num_prompt_tokens < p.min_tokens:
                min_tokens.add(i, {t for t in p.all_stop_token_ids if t < vocab_size})
        md.allowed, md.banned, md.logit_bias = allowed.to(device), banned.to(device), bias.to(device)
        if md.allowed is not None:  # the rows to clear, listed here (unique() on the device syncs)
            md.allowed += (host_to_device(cleared, torch.int64, device),)
        md.min_tokens = min_tokens.to(device)
        md.penalties = _penalty_rows(rows, vocab_size, device, counts, table, slots, slots_on_device, flag,
                                     drafts, run_start, ahead)
        return md

    def __call__(self, logits: torch.Tensor, rows: Seq[Any],
                 md: SamplingMetadata | None = None) -> SamplerOutput:
        if md is None:
            md = self.prepare(rows, logits.shape[1], logits.device, counts=self.counts)
        if md.all_greedy and not md.want_logprobs and not (
                md.penalties or md.min_tokens or md.allowed or md.banned or md.logit_bias):
            # The argmax and its logprob in one pass over the model's logits (kernels/sampling.py),
            # guided rows masked first.
            return SamplerOutput(*kernels.greedy_sample(self._mask_by_grammar(logits, md)))
        # Before everything else, as vLLM applies the grammar's bitmask to the model's logits:
        # logprobs are those of the distribution the grammar leaves.
        logits = self._mask_by_grammar(logits.float(), md)
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        # Only allowed_token_ids and bad words add -inf: they may leave a guided row nothing.
        clash = md.grammar_rows is not None and bool(md.allowed or md.banned)
        if clash:
            grammar_only = logits[md.grammar_rows]  # (a copy)
        logits = self._apply_penalties(logits, md)
        if clash:
            # Where they leave nothing the grammar allows, the grammar alone decides (an all
            # -inf row has no distribution to sample).
            guided = logits[md.grammar_rows]
            dead = torch.isneginf(guided).all(dim=1, keepdim=True)
            logits[md.grammar_rows] = torch.where(dead, grammar_only, guided)
        token_ids = self._sample(logits, rows, md)
        p = md.penalties
        if p is not None and p.count_samples:  # the next step's penalties see these tokens
            sampled = token_ids if p.rows is None else token_ids[p.rows]
            p.counts.count(p.slots, sampled, p.kept(sampled))
        out = SamplerOutput(token_ids, raw_logprobs.gather(1, token_ids[:, None]).squeeze(1))
        if md.want_logprobs:
            if md.max_logprobs:
                out.top_logprobs, out.top_token_ids = raw_logprobs.topk(md.max_logprobs, dim=-1)
            out.ranks = (raw_logprobs > out.logprobs[:, None]).sum(dim=-1) + 1
            out.num_logprobs = md.row_logprobs
        return out

    @staticmethod
    def _mask_by_grammar(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """-inf where a guided row's grammar does not allow the token (in place)."""
        if md.grammar_rows is not None:
            allowed = unpack_bitmask(md.grammar_bitmask, logits.shape[1])
            logits[md.grammar_rows] = logits[md.grammar_rows].masked_fill(~allowed, float("-inf"))
        return logits

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        # vLLM's order: allowed ids, bad words, logit bias, then the penalties on what remains.
        # Each kind is a few indexing ops over all rows' (row, token) pairs at once.
        if md.allowed is not None:
            rows, ids, cleared = md.allowed
            kept = logits[rows, ids]
            logits[cleared] = float("-inf")
            logits[rows, ids] = kept
        if md.banned is not None:
            rows, ids = md.banned
            logits[rows, ids] = float("-inf")
        if md.logit_bias is not None:
            rows, ids, bias = md.logit_bias
            logits[rows, ids] += bias
        if md.penalties is not None:
            apply_penalties(logits, md.penalties)
        if md.min_tokens is not None:
            rows, ids = md.min_tokens
            logits[rows, ids] = float("-inf")
        return logits

    @staticmethod
    def _sample(logits: torch.Tensor, rows: Seq[Any], md: SamplingMetadata) -> torch.Tensor:
        greedy_ids = logits.argmax(dim=-1)
        if md.all_greedy:  # the common benchmark case: no second pass
            return greedy_ids
        logits = logits / md.temperature[:, None]
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = torch.softmax(logits, dim=-1)
        q = torch.empty_like(probs).exponential_()
        for i, seed, index, position in md.seeded:
            md.generator.manual_seed(_draw_seed(seed, index, position))
            q[i].exponential_(generator=md.generator)
        race = probs / q
        sampled = race.argmax(dim=-1)
        if md.drafts is not None:
            sampled = verification.verify_drafts(probs, race, sampled, md.drafts)
        return torch.where(md.greedy, greedy_ids, sampled)


def _draw_seed(seed: int, index: int, position: int) -> int:
    """The seed of one token's draw: (request seed, sample index, token position) mixed by
    splitmix64's finalizer into 63 bits, so nearby tuples give unrelated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + position) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 1


def _penalty_rows(rows: Seq[Any], vocab_size: int, device: torch.device,
                  counts: PenaltyCounts | None, table: SamplingTable, slots: np.ndarray,
                  slots_on_device: torch.Tensor | None, flag: dict[str, np.ndarray],
                  drafts: Seq[int] | None = None, run_start: Seq[int] = (),
                  ahead: Seq[int] = ()) -> PenaltyRows | None:
    penalized = np.flatnonzero(flag["has_penalties"]).tolist()
    if not penalized:
        return None
    seqs = [rows[i] for i in penalized]
    # Verification runs (`verification_runs`): row i of a run starting at row s is penalized as
    # if the proposals before it had been sampled, the tokens from ahead[s] to ahead[i] from the end.
    spec = any(ahead[i] for i in penalized) if ahead else False
    proposed = {rows[i].seq_id: ahead[i] for i in penalized if spec and run_start[i] == i and ahead[i]}
    if counts is None:
        counts_table = PenaltyCounts.transient(seqs, vocab_size, device, proposed)
        count_slots = list(range(len(seqs)))
    else:
        counts_table, count_slots = counts, counts.slots_for(seqs, proposed)
    every_row = len(penalized) == len(rows)
    param_slots = slots_on_device if every_row else slots_on_device[host_to_device(penalized, torch.int64, device)]
    out = PenaltyRows(
        counts_table, None if every_row else host_to_device(penalized, torch.int64, device),
        host_to_device(count_slots, torch.int64, device),
        table.repetition[param_slots] if flag["has_repetition"].any() else None,
        table.frequency[param_slots] if flag["has_additive"].any() else None,
        table.presence[param_slots] if flag["has_additive"].any() else None,
        count_samples=counts is not None)
    if spec:
        q_of = {i: q for q, i in enumerate(penalized)}  # a run's rows are all penalized (one sequence)
        pairs = TokenPairs(1)
        for q, i in enumerate(penalized):
            tokens = seqs[q].token_ids
            before = np.asarray(tokens[len(tokens) - ahead[run_start[i]]:len(tokens) - ahead[i]], dtype=np.int64)
            ids, times = np.unique(before[(before >= 0) & (before < vocab_size)], return_counts=True)
            pairs.add(q, ids, times)
        out.proposed = pairs.to(device)  # (rows among the penalized, token ids, times)
        out.drafts = host_to_device([drafts[i] for i in penalized], torch.int64, device)
        out.run_first = host_to_device([q_of[run_start[i]] for i in penalized], torch.int64, device)
    return out


@dataclass
class PromptLogprobsOutput:
    token_logprobs: torch.Tensor  # [R] float32, log p(prompt token | the tokens before it)
    ranks: torch.Tensor  # [R] int64, 1 = the most likely token
    top_logprobs: torch.Tensor | None = None  # [R, K]
    top_token_ids: torch.Tensor | None = None  # [R, K]


def compute_prompt_logprobs(compute_logits, hidden: torch.Tensor, targets: torch.Tensor,
                            num_top: int, rows_per_pass: int) -> PromptLogprobsOutput:
    """Logprobs of `targets` under the model's raw distribution at each row of `hidden`, their
    ranks and the `num_top` most likely tokens. Rows go `rows_per_pass` at a time: a whole
    prompt's logits (tokens x vocabulary in float32) could outgrow the memory the KV cache
    leaves."""
    parts: list[tuple] = []
    for start in range(0, hidden.shape[0], rows_per_pass):
        logprobs = torch.log_softmax(compute_logits(hidden[start:start + rows_per_pass]).float(), dim=-1)
        target = targets[start:start + rows_per_pass]
        chosen = logprobs.gather(1, target[:, None]).squeeze(1)
        ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
        top = logprobs.topk(num_top, dim=-1) if num_top else None
        parts.append((chosen, ranks, *(top if top is not None else ())))
        del logprobs
    cat = [torch.cat([p[i] for p in parts]) for i in range(len(parts[0]))]
    return PromptLogprobsOutput(*cat)


def _banned_by_bad_words(words: list[list[int]], output: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens end the output so far."""
    banned = set()
    for w in words:
        prefix = len(w) - 1
        if prefix <= len(output) and (prefix == 0 or output[-prefix:] == w[:-1]):
            banned.add(w[-1])
    return sorted(banned)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep the k most likely tokens, then the smallest set whose probability reaches top_p."""
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        positions = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(positions >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop = before >= top_p[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def bitmask_words(vocab_size: int) -> int:
    """Words of a grammar bitmask row (backend/engine/structured_output.py)."""
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool: which tokens each row allows."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
