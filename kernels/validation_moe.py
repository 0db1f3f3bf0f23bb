"""Argument checks of the fused mixture-of-experts layer (kernels/moe.py and its reference).
Imports only torch. Every failed check raises ValueError("<op>: <what is wrong>, got <value>")."""

from __future__ import annotations

import torch

from .validation import (INDEX_DTYPES, check_contiguous, check_last_dim_contiguous,
                         check_same_device, check_shape, check_tensor, fail)

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
FP8_BLOCK = 128  # block-wise FP8 scales cover 128 output channels x 128 inputs (DeepSeek-V3, Qwen3 FP8)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_kind(op: str, name: str, scale, weight: torch.Tensor) -> int:
    """0: no scale (16/32-bit weights); 1: per output channel [E, N]; 2: block-wise
    [E, ceil(N / 128), ceil(K / 128)]. weight is [E, N, K]."""
    if weight.dtype != FP8_WEIGHT_DTYPE:
        if scale is not None:
            fail(op, f"{name} is only for {FP8_WEIGHT_DTYPE} weights, got one with {weight.dtype} weights")
        return 0
    if scale is None:
        fail(op, f"{name} is required with {FP8_WEIGHT_DTYPE} weights, got None")
    e, n, k = weight.shape
    channel, block = (e, n), (e, _cdiv(n, FP8_BLOCK), _cdiv(k, FP8_BLOCK))
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or \
            tuple(scale.shape) not in (channel, block):
        what = (f"{type(scale).__name__}" if not isinstance(scale, torch.Tensor)
                else f"{scale.dtype} {tuple(scale.shape)}")
        fail(op, f"{name} must be float32 [E, N] = {channel} (per channel) or [E, N/128, K/128] = "
                 f"{block} (128 x 128 blocks), got {what}")
    check_contiguous(op, name, scale)
    return 1 if tuple(scale.shape) == channel else 2


def check_fused_moe(op: str, x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale,
                    dtypes: tuple[torch.dtype, ...]) -> tuple[int, int]:
    """x [M, H]; w13 [E, 2*I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights float32
    and topk_ids int32/int64 [M, top_k]; weights in x's dtype or float8_e4m3fn with scales.
    Returns the kinds of the two scales (see scale_kind)."""
    check_tensor(op, "x", x, "[M, H]", dtypes)
    check_last_dim_contiguous(op, "x", x)
    m, h = x.shape
    weight_dtypes = (x.dtype, FP8_WEIGHT_DTYPE)
    check_tensor(op, "w13", w13, "[E, 2*I, H]", weight_dtypes)
    check_tensor(op, "w2", w2, "[E, H, I]", weight_dtypes)
    e, two_i, _ = w13.shape
    if two_i % 2:
        fail(op, f"w13 must stack gate and up rows, [E, 2*I, H] with an even second dimension, got "
                 f"shape {tuple(w13.shape)}")
    check_shape(op, "w13", w13, (e, two_i, h), "[E, 2*I, H]")
    check_shape(op, "w2", w2, (e, h, two_i // 2), "[E, H, I]")
    if w2.dtype != w13.dtype:
        fail(op, f"w2 must have the dtype of w13 ({w13.dtype}), got {w2.dtype}")
    for name, t in (("w13", w13), ("w2", w2)):
        check_last_dim_contiguous(op, name, t)
    check_tensor(op, "topk_ids", topk_ids, "[M, top_k]", INDEX_DTYPES)
    if topk_ids.shape[0] != m or topk_ids.shape[1] == 0:
        fail(op, f"topk_ids must have shape [M, top_k] with M = {m} and top_k >= 1, got "
                 f"{tuple(topk_ids.shape)}")
    check_tensor(op, "topk_weights", topk_weights, "[M, top_k]", (torch.float32,))
    check_shape(op, "topk_weights", topk_weights, tuple(topk_ids.shape), "topk_ids.shape")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        check_contiguous(op, name, t)
    kinds = scale_kind(op, "w13_scale", w13_scale, w13), scale_kind(op, "w2_scale", w2_scale, w2)
    tensors = {"x": x, "w13": w13, "w2": w2, "topk_weights": topk_weights, "topk_ids": topk_ids}
    tensors.update({n: s for n, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale)) if s is not None})
    check_same_device(op, tensors)
    return kinds


def check_align(op: str, topk_ids, num_experts: int, block_m: int) -> None:
    check_tensor(op, "topk_ids", topk_ids, "[M, top_k]", INDEX_DTYPES)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        fail(op, f"num_experts must be a positive int, got {num_experts!r}")
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 1 or block_m & (block_m - 1):
        fail(op, f"block_m must be a power of two, got {block_m!r}")



# The router kernel keeps one token's logits in registers.
MAX_ROUTED_EXPERTS = 1024


def check_topk_softmax(op: str, logits, top_k: int, round_to) -> None:
    check_tensor(op, "logits", logits, "[M, E]", (torch.float16, torch.bfloat16, torch.float32))
    check_last_dim_contiguous(op, "logits", logits)
    experts = logits.shape[1]
    if not 1 <= experts <= MAX_ROUTED_EXPERTS:
        fail(op, f"logits must have 1 to {MAX_ROUTED_EXPERTS} experts, got {experts}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        fail(op, f"top_k must be an int in 1..{experts}, got {top_k!r}")
    if round_to not in (None, torch.float16, torch.bfloat16, torch.float32):
        fail(op, f"round_to must be None, float16, bfloat16 or float32, got {round_to!r}")
