"""Fused mixture-of-experts layer: out[m] = sum over the token's top-k experts e of
weight[m, k] * w2[e] @ (silu(gate_e(x[m])) * up_e(x[m])), with w13[e] = cat(gate, up) rows.

Three steps, as vLLM's and SGLang's fused MoE (our own code):
1. `moe_align.moe_align_block_size` sorts the M * top_k (token, k) pairs by expert and pads each
   expert's group to a multiple of BLOCK_M (torch ops on the device, no host sync), so every
   BLOCK_M-row tile belongs to one expert. An expert without pairs has no tile: it costs nothing.
2. `_gate_up_kernel`, a grouped GEMM: a program takes one tile of pairs (rows of x gathered
   through the sorted ids) and BLOCK_N columns of the intermediate size I, and walks H with two
   dots on the same x tile, one against the expert's gate rows and one against its up rows. The
   epilogue is SiLU-and-multiply, with Hugging Face's rounding points (gate and up rounded to the
   dtype, silu in float32 rounded to the dtype, then the product), so the [pairs, I] activation
   is written once and the [pairs, 2 * I] one never exists.
3. `_down_kernel`, a grouped GEMM of those rows with w2[e] [H, I]; the epilogue multiplies by the
   pair's routing weight (float32) and writes the pair's row: with top_k = 1 straight into the
   output, else as float32 into slice k of [top_k, M, H], which `split_k.sum_slices` adds in a
   fixed order and casts in one kernel (no atomics: the result does not depend on timing).

Padding rows (the sentinel M * top_k) load zeros and never store. Tiles past the used length
(the grid is sized for the worst case, from host sizes only) return at once.

FP8 weights (float8_e4m3fn) are widened to the activations' dtype in registers (every e4m3 value
is exact in fp16 and bf16; W8A16, activations are not quantized); per-output-channel scales
[E, N] multiply the float32 sums after the K loop, 128 x 128 block scales [E, N/128, K/128]
multiply each K step's sums (BLOCK_K divides 128).

Tiles come from a config per bucket of rows per expert; a table of measured configs per GPU,
layer shape, weight dtype and bucket (kernels/configs/fused_moe.json, written by
`benchmarks/kernels/fused_moe.py --sweep --write-configs`) overrides the defaults. A table, not an
autotuner at start-up: the choice, and so the summation order, is the same in every run.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import validation
from .validation_moe import FP8_BLOCK, check_fused_moe
from ._launch import cdiv, check_runnable
from ._tuned import device_name, load_table
from .moe_align import moe_align_block_size
from .split_k import finish, slices_or_output

OP = "fused_moe"


@dataclass(frozen=True)
class FusedMoEConfig:
    block_m: int = 16  # pair rows a tile (a tile never mixes experts)
    block_n: int = 64  # output columns a program (of I in the gate/up GEMM, of H in the down GEMM)
    block_k: int = 64  # reduction step; divides 128 for block-wise FP8 scales
    group_m: int = 1  # row tiles that walk the column tiles together (L2 reuse of x rows)
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            side = getattr(self, name)
            if side < 16 or side & (side - 1):
                raise ValueError(f"{name} must be a power of two of at least 16, got {side}")
        if self.group_m < 1 or self.num_warps not in (1, 2, 4, 8) or self.num_stages < 1:
            raise ValueError(f"group_m and num_stages must be at least 1 and num_warps 1, 2, 4 or 8, got {self}")


# Defaults by rows per expert (M * top_k / E, the rows one expert's tiles hold on average), in the
# shape of vLLM's defaults; decode batches (1 and 4 rows an expert) have buckets of their own so
# that the tuned table can give them tiles of their own.
ROW_BUCKETS = (1, 4, 16, 64, 256)  # and more
DEFAULT_CONFIGS = {
    1: FusedMoEConfig(16, 64, 128, 1, 4, 4),
    4: FusedMoEConfig(16, 64, 128, 1, 4, 4),
    16: FusedMoEConfig(16, 64, 128, 1, 4, 4),
    64: FusedMoEConfig(32, 64, 128, 4, 4, 3),
    256: FusedMoEConfig(64, 64, 64, 8, 4, 3),
    0: FusedMoEConfig(64, 128, 64, 8, 8, 3),
}


def row_bucket(rows_per_expert: int) -> int:
    return next((b for b in ROW_BUCKETS if rows_per_expert <= b), 0)


def default_config(m: int, top_k: int, num_experts: int, dtype: torch.dtype) -> FusedMoEConfig:
    cfg = DEFAULT_CONFIGS[row_bucket(cdiv(m * top_k, num_experts))]
    if dtype == torch.float32:  # (tests) float32 tiles take twice the shared memory
        cfg = FusedMoEConfig(cfg.block_m, min(cfg.block_n, 64), 32, cfg.group_m, cfg.num_warps, 2)
    return cfg


TUNED_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "fused_moe.json")


def config_key(num_experts: int, top_k: int, hidden: int, inter: int, weight_dtype: torch.dtype,
               bucket: int) -> str:
    """The tuned table's key, like "e128-top8-h2048-i768/bfloat16/m16" ("mbig": the last bucket)."""
    dtype = str(weight_dtype).removeprefix("torch.")
    return f"e{num_experts}-top{top_k}-h{hidden}-i{inter}/{dtype}/m{bucket or 'big'}"


def load_tuned_configs(path: str = TUNED_CONFIGS) -> dict[str, dict[str, FusedMoEConfig]]:
    """{GPU name: {config_key: config}} from the table; empty when there is none."""
    return load_table(path, FusedMoEConfig)


def choose_config(m: int, top_k: int, num_experts: int, hidden: int, inter: int, weight_dtype: torch.dtype,
                  dtype: torch.dtype, device_name: str, path: str | None = None) -> FusedMoEConfig:
    """The table's config for this GPU model, layer shape, weight dtype and bucket, else the default."""
    bucket = row_bucket(cdiv(m * top_k, num_experts))
    table = load_tuned_configs(path or TUNED_CONFIGS).get(device_name, {})
    tuned = table.get(config_key(num_experts, top_k, hidden, inter, weight_dtype, bucket))
    return tuned or default_config(m, top_k, num_experts, dtype)


@triton.jit
def _tile(num_post_ptr, expert_ids_ptr, sorted_ptr, num_pairs, N, num_tiles_m,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's row tile, column tile, expert (-1: nothing to do), pair ids and their mask."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    expert = tl.load(expert_ids_ptr + pid_m)
    expert = tl.where(pid_m * BLOCK_M < tl.load(num_post_ptr), expert, -1)
    ids = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return pid_n, expert, ids, ids < num_pairs


@triton.jit
def _step(acc, a, w_ptrs, k_mask, n_mask, scale_ptrs, SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc += a @ w for one K step; w [BLOCK_K, BLOCK_N] widened from FP8 to a's dtype when it is
    FP8, times its block scales when SCALE == 2."""
    w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(a.dtype)
    if SCALE == 2:
        s = tl.load(scale_ptrs, mask=n_mask, other=0.0)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION) * s[None, :]
    else:
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, scale_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, out_ptr,
    num_pairs, N, K, num_tiles_m, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_om,
    TOP_K: tl.constexpr, SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """out[pair, n] = silu(x[pair // TOP_K] @ gate_e[n]) * (x[pair // TOP_K] @ up_e[n]), n < N = I."""
    pid_n, expert, ids, valid = _tile(num_post_ptr, expert_ids_ptr, sorted_ptr, num_pairs, N, num_tiles_m,
                                      BLOCK_M, BLOCK_N, GROUP_M)
    if expert < 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    a_ptrs = x_ptr + (ids // TOP_K).to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    gate_ptrs = w_base + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    up_ptrs = gate_ptrs + N * stride_wn
    s_base = scale_ptr + expert.to(tl.int64) * stride_se
    gate_scale = s_base + (offs_n // 128) * stride_sn
    up_scale = s_base + ((offs_n + N) // 128) * stride_sn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs + k0, mask=valid[:, None] & k_mask[None, :], other=0.0)
        kb = (k0 // 128) * stride_sk
        gate = _step(gate, a, gate_ptrs + k0, k_mask, n_mask, gate_scale + kb, SCALE, DOT_PRECISION)
        up = _step(up, a, up_ptrs + k0, k_mask, n_mask, up_scale + kb, SCALE, DOT_PRECISION)
    if SCALE == 1:
        gate *= tl.load(s_base + offs_n * stride_sn, mask=n_mask, other=0.0)[None, :]
        up *= tl.load(s_base + (offs_n + N) * stride_sn, mask=n_mask, other=0.0)[None, :]
    dtype = out_ptr.dtype.element_ty
    g = gate.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    h = (silu * up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + ids.to(tl.int64)[:, None] * stride_om + offs_n[None, :], h,
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, scale_ptr, topk_w_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, out_ptr,
    num_pairs, N, K, num_tiles_m, stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_sk,
    stride_os, stride_om,
    TOP_K: tl.constexpr, SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """out[pair % TOP_K, pair // TOP_K, n] = weight[pair] * h[pair] @ w2_e[n], n < N = H."""
    pid_n, expert, ids, valid = _tile(num_post_ptr, expert_ids_ptr, sorted_ptr, num_pairs, N, num_tiles_m,
                                      BLOCK_M, BLOCK_N, GROUP_M)
    if expert < 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    a_ptrs = h_ptr + ids.to(tl.int64)[:, None] * stride_hm + offs_k[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    s_base = scale_ptr + expert.to(tl.int64) * stride_se
    block_scale = s_base + (offs_n // 128) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs + k0, mask=valid[:, None] & k_mask[None, :], other=0.0)
        acc = _step(acc, a, w_ptrs + k0, k_mask, n_mask, block_scale + (k0 // 128) * stride_sk, SCALE,
                    DOT_PRECISION)
    if SCALE == 1:
        acc *= tl.load(s_base + offs_n * stride_sn, mask=n_mask, other=0.0)[None, :]
    acc *= tl.load(topk_w_ptr + ids, mask=valid, other=0.0)[:, None]
    rows = (ids % TOP_K).to(tl.int64) * stride_os + (ids // TOP_K).to(tl.int64) * stride_om
    tl.store(out_ptr + rows[:, None] + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_mask[None, :])


def _scale_args(scale: torch.Tensor | None, kind: int, like: torch.Tensor):
    """(pointer, stride_e, stride_n, stride_k) of a scale tensor; the weight stands in when none."""
    if kind == 0:
        return like, 0, 0, 0
    if kind == 1:
        return scale, scale.stride(0), scale.stride(1), 0
    return scale, scale.stride(0), scale.stride(1), scale.stride(2)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, *, config: FusedMoEConfig | None = None) -> torch.Tensor:
    """x [M, H] -> [M, H] in x's dtype; see the module docstring."""
    k13, k2 = check_fused_moe(OP, x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale,
                              validation.HALF_AND_FLOAT)
    check_runnable(OP, x)
    m, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    cfg = config or choose_config(m, top_k, num_experts, hidden, inter, w13.dtype, x.dtype, device_name(x.device))
    if config is None and (k13 == 2 or k2 == 2) and FP8_BLOCK % cfg.block_k:
        # A tuned entry is keyed by the weight dtype, not the scale kind: block scales need K
        # steps inside one 128-wide block.
        cfg = dataclasses.replace(cfg, block_k=FP8_BLOCK)
    if (k13 == 2 or k2 == 2) and FP8_BLOCK % cfg.block_k:
        validation.fail(OP, f"block-wise FP8 scales need a block_k that divides {FP8_BLOCK}, got {cfg.block_k}")
    if m == 0 or hidden == 0:
        return torch.zeros(m, hidden, dtype=x.dtype, device=x.device)
    pairs = m * top_k
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, num_experts, cfg.block_m)
    tiles_m = expert_ids.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    tiles = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    if inter:
        _gate_up_kernel[(tiles_m * cdiv(inter, cfg.block_n),)](
            x, w13, *_scale_args(w13_scale, k13, w13)[:1], sorted_ids, expert_ids, num_post, h,
            pairs, inter, hidden, tiles_m, x.stride(0), w13.stride(0), w13.stride(1),
            *_scale_args(w13_scale, k13, w13)[1:], h.stride(0),
            TOP_K=top_k, SCALE=k13, DOT_PRECISION=precision, **tiles)
    else:
        h.zero_()
    out = slices_or_output(top_k, m, hidden, x.dtype, x.device)
    _down_kernel[(tiles_m * cdiv(hidden, cfg.block_n),)](
        h, w2, *_scale_args(w2_scale, k2, w2)[:1], topk_weights, sorted_ids, expert_ids, num_post, out,
        pairs, hidden, inter, tiles_m, h.stride(0), w2.stride(0), w2.stride(1),
        *_scale_args(w2_scale, k2, w2)[1:], out.stride(0), out.stride(1),
        TOP_K=top_k, SCALE=k2, DOT_PRECISION=precision, **tiles)
    return finish(out, x.dtype)
