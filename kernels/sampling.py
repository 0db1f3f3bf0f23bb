"""Greedy sampling in one pass over the logits: the argmax of each row and its log-probability;
and the penalties (repetition, frequency, presence) in one pass from token counts on the device.

The general sampler upcasts the logits to float32, writes the whole log-softmax and reads it back
(four passes over a [rows, vocab] tensor, every decode step). Greedy rows without penalties or requested logprobs need only the argmax and
log p(argmax) = max - logsumexp = -log(sum(exp(x - max))), which one online pass gives: each lane
keeps its running max, the first index where it was reached, and its sum of exp(x - max).
Ties go to the lowest index, as torch.argmax does, so token ids match the reference exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import validation, validation_ops
from ._launch import check_runnable, next_pow2

OP = "greedy_sample"
OP_PENALTIES = "apply_penalties"


@triton.jit
def _greedy_kernel(logits_ptr, token_ptr, logprob_ptr, vocab, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    lanes = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    idx = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + lanes
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, x)
        # A lane that has seen only -inf keeps s = 0: shift by 0 there, as -inf - -inf is NaN.
        shift = tl.where(new_m == float("-inf"), 0.0, new_m)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        idx = tl.where(x > m, offs, idx)  # strictly greater: a lane keeps its first maximum
        m = new_m
    row_max = tl.max(m, 0)
    total = tl.sum(s * tl.exp(m - tl.where(row_max == float("-inf"), 0.0, row_max)), 0)
    first = tl.min(tl.where(m == row_max, idx, vocab), 0)
    tl.store(token_ptr + row, first.to(tl.int64))
    tl.store(logprob_ptr + row, -tl.log(total))


def greedy_sample(logits: torch.Tensor, *, block: int = 4096,
                  num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] -> (token_ids int64 [R], logprobs float32 [R]): the first argmax of each
    row and its log-softmax value, computed in float32."""
    validation_ops.check_greedy_sample(OP, logits, validation.HALF_AND_FLOAT)
    check_runnable(OP, logits)
    rows, vocab = logits.shape
    token_ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return token_ids, logprobs
    _greedy_kernel[(rows,)](logits, token_ids, logprobs, vocab, logits.stride(0),
                            BLOCK=min(block, next_pow2(vocab)), num_warps=num_warps)
    return token_ids, logprobs


@triton.jit
def _penalties_kernel(logits_ptr, rows_ptr, slots_ptr, counts_ptr, in_prompt_ptr, rep_ptr, freq_ptr,
                      pres_ptr, vocab, stride_logits, stride_counts, stride_prompt,
                      HAS_ROWS: tl.constexpr, HAS_REP: tl.constexpr, HAS_ADD: tl.constexpr,
                      BLOCK: tl.constexpr):
    q = tl.program_id(0)
    row = (tl.load(rows_ptr + q) if HAS_ROWS else q).to(tl.int64)
    slot = tl.load(slots_ptr + q).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = offs < vocab
    x = tl.load(logits_ptr + row * stride_logits + offs, mask=live)
    c = tl.load(counts_ptr + slot * stride_counts + offs, mask=live, other=0).to(tl.float32)
    if HAS_REP:
        rep = tl.load(rep_ptr + q)
        seen = (c > 0) | (tl.load(in_prompt_ptr + slot * stride_prompt + offs, mask=live, other=0) != 0)
        # Rounded divisions, as torch's: the same logits, so the same sampled tokens.
        x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, rep), x * rep), x)
    if HAS_ADD:
        x = x - (tl.load(freq_ptr + q) * c + tl.load(pres_ptr + q) * (c > 0).to(tl.float32))
    tl.store(logits_ptr + row * stride_logits + offs, x, mask=live)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor | None, slots: torch.Tensor,
                    output_counts: torch.Tensor, in_prompt: torch.Tensor,
                    repetition: torch.Tensor | None, frequency: torch.Tensor | None,
                    presence: torch.Tensor | None, *, block: int = 2048, num_warps: int = 4) -> torch.Tensor:
    """Repetition, frequency and presence penalties in one pass, in place on float32 logits
    [R, V]. Row rows[q] (q when rows is None) reads the counts of slot slots[q]:
    output_counts [S, V] (int16/int32: how often each token was sampled) and in_prompt [S, V]
    (bool). repetition [Q] divides positive logits and multiplies negative ones of tokens in
    the prompt or output; then frequency [Q] per count and presence [Q] once per sampled token
    are subtracted (both or neither given)."""
    validation_ops.check_penalties(OP_PENALTIES, logits, rows, slots, output_counts, in_prompt, repetition,
                               frequency, presence)
    check_runnable(OP_PENALTIES, logits)
    num_rows, vocab = slots.shape[0], logits.shape[1]
    if num_rows == 0 or (repetition is None and frequency is None):
        return logits
    block = min(block, next_pow2(vocab))
    dummy = slots  # (an unread pointer where a constexpr flag turns its use off)
    _penalties_kernel[(num_rows, triton.cdiv(vocab, block))](
        logits, rows if rows is not None else dummy, slots, output_counts, in_prompt,
        repetition if repetition is not None else dummy, frequency if frequency is not None else dummy,
        presence if presence is not None else dummy, vocab, logits.stride(0), output_counts.stride(0),
        in_prompt.stride(0), HAS_ROWS=rows is not None, HAS_REP=repetition is not None,
        HAS_ADD=frequency is not None, BLOCK=block, num_warps=num_warps, enable_fp_fusion=False)
    return logits
