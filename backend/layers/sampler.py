"""Sampler: penalties, temperature, min-p, top-k, top-p, seeded sampling and logprobs.

Works on a [num_rows, vocab] float32 logits tensor; each row comes with an object carrying
`params` (SamplingParams), `token_ids`, `num_prompt_tokens`, `index` and `generator`
(a Sequence). Rows with a seed draw from their own generator, so their tokens do not depend
on whatever else is in the batch. Order of processing, as in vLLM: penalties, min_tokens,
temperature, min_p, top_k, top_p, then sampling by the exponential race (argmax of p / E with
E ~ Exp(1), which draws from p). Logprobs are of the model's raw distribution.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence as Seq

import torch


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor  # [R] float32, log p(sampled token) under the raw distribution
    top_logprobs: torch.Tensor | None = None  # [R, K] values, K = max requested
    top_token_ids: torch.Tensor | None = None  # [R, K]
    ranks: torch.Tensor | None = None  # [R] rank of the sampled token (1 = most likely)


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: Seq[Any]) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties(logits, rows)
        logits = self._apply_min_tokens(logits, rows)
        token_ids = self._sample(logits, rows)
        out = SamplerOutput(token_ids, raw_logprobs.gather(1, token_ids[:, None]).squeeze(1))
        k = max((r.params.logprobs or 0) for r in rows)
        if any(r.params.logprobs is not None for r in rows):
            if k:
                out.top_logprobs, out.top_token_ids = raw_logprobs.topk(k, dim=-1)
            out.ranks = (raw_logprobs > out.logprobs[:, None]).sum(dim=-1) + 1
        return out

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: Seq[Any]) -> torch.Tensor:
        vocab = logits.shape[1]
        for i, r in enumerate(rows):
            p = r.params
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted({t for t in r.token_ids if t < vocab}),
                                    dtype=torch.long, device=logits.device)
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                              vals * p.repetition_penalty)
            if p.presence_penalty or p.frequency_penalty:
                out_ids = [t for t in r.token_ids[r.num_prompt_tokens:] if t < vocab]
                if out_ids:
                    counts = torch.zeros(vocab, device=logits.device)
                    counts.index_add_(0, torch.tensor(out_ids, device=logits.device),
                                      torch.ones(len(out_ids), device=logits.device))
                    logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return logits

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, rows: Seq[Any]) -> torch.Tensor:
        for i, r in enumerate(rows):
            if r.params.min_tokens and len(r.token_ids) - r.num_prompt_tokens < r.params.min_tokens:
                stop = [t for t in r.params.all_stop_token_ids if t < logits.shape[1]]
                if stop:
                    logits[i, stop] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, rows: Seq[Any]) -> torch.Tensor:
        greedy_ids = logits.argmax(dim=-1)
        if all(r.params.greedy for r in rows):  # the common benchmark case: no second pass
            return greedy_ids
        greedy = torch.tensor([r.params.greedy for r in rows], device=logits.device)
        temps = torch.tensor([r.params.temperature if not r.params.greedy else 1.0 for r in rows],
                             device=logits.device)
        logits = logits / temps[:, None]
        logits = apply_min_p(logits, [r.params.min_p for r in rows])
        logits = apply_top_k_top_p(logits, [r.params.top_k for r in rows], [r.params.top_p for r in rows])
        probs = torch.softmax(logits, dim=-1)
        q = torch.empty_like(probs).exponential_()
        for i, r in enumerate(rows):
            if r.params.seed is not None and not r.params.greedy:
                if r.generator is None:
                    r.generator = torch.Generator(device=logits.device).manual_seed(r.params.seed + r.index)
                q[i].exponential_(generator=r.generator)
        sampled = (probs / q).argmax(dim=-1)
        return torch.where(greedy, greedy_ids, sampled)


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    if not any(min_p):
        return logits
    mp = torch.tensor(min_p, device=logits.device, dtype=logits.dtype)
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * mp[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Keep the k most likely tokens, then the smallest set whose probability reaches top_p."""
    use_k, use_p = any(k > 0 for k in top_k), any(p < 1.0 for p in top_p)
    if not use_k and not use_p:
        return logits
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if use_k:
        k = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)
        positions = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(positions >= k[:, None], float("-inf"))
    if use_p:
        p = torch.tensor(top_p, device=logits.device, dtype=torch.float32)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop = before >= p[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
