"""The GEMV for a few rows at once (`method="gemv"` with `block_m` > 1): decode batches of 2-8.

The one-row GEMV run once per row reads every weight once per row, and the tensor-core kernel
widens each weight into 16 bits and takes it through shared memory to the MMA. Here a program
reads its weight words once and multiplies each field into every row's running sum on the CUDA
cores: per weight one AND or shift and BLOCK_M FFMAs, so up to about eight rows the loop stays
near the weight-read time. Fields, zeros and scales as in the one-row GEMV
(kernels/w4a16_paths.py); rows past M are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv
from .split_k import finish, slices_or_output
from .w4a16_layout import W4A16Config, _input_rows, _load
from .w4a16_paths import X_EXP, _apply_groups, _fma_fields, _join_fields, gemv_split_k, slice_rows


@triton.jit
def _w4a16_gemv_rows_kernel(
    x_ptr, qw_ptr, scale_ptr, zero_ptr, perm_ptr, out_ptr, M, N, K, K_SLICE,
    stride_xm, stride_sg, stride_os, stride_om,
    STRIDE_QK: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, HAS_PERM: tl.constexpr,
    EVEN_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
    X_EXP: tl.constexpr, WORDS: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    XS: tl.constexpr = 1.0 * (1 << X_EXP)
    pid_w = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_w = tl.max_contiguous(pid_w * BLOCK_W + tl.arange(0, BLOCK_W), WORDS)
    w_mask = offs_w < N // PACK
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    x_rows = x_ptr + tl.minimum(offs_m, M - 1).to(tl.int64) * stride_xm  # [BLOCK_M]
    offs_k = tl.arange(0, BLOCK_K)
    q_ptrs = qw_ptr + offs_k[:, None] * STRIDE_QK + offs_w[None, :]
    k_lo = pid_k * K_SLICE
    k_hi = tl.minimum(k_lo + K_SLICE, K)
    a0 = tl.zeros((BLOCK_M, BLOCK_W), dtype=tl.float32)
    a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
    o0, o1, o2, o3, o4, o5, o6, o7 = a0, a0, a0, a0, a0, a0, a0, a0
    xs = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        qt = _load(q_ptrs + k0 * STRIDE_QK, w_mask[None, :], EVEN_W).to(tl.uint32, bitcast=True)
        for r in tl.static_range(BLOCK_K):
            # Each thread holds every row of its words (picking row r costs no instruction); the
            # activations of row r, one per input row, come from L1.
            q = tl.sum(tl.where(offs_k[:, None] == r, qt, 0), axis=0)
            x = tl.load(x_rows + _input_rows(perm_ptr, k0 + r, HAS_PERM)).to(tl.float32) * XS
            xs += x
            # Each field of the row of words [W] times each input row's activation [R], into [R, W].
            a0, a1, a2, a3, a4, a5, a6, a7 = _fma_fields(q[None, :], x[:, None], a0, a1, a2, a3, a4, a5, a6, a7,
                                                         BITS)
        k1 = k0 + BLOCK_K
        if (k1 % GROUP == 0) | (k1 >= k_hi):  # a group's end: its zero and scale apply once
            g = k0 // GROUP
            sx = (xs * (1.0 / XS))[:, None]
            sp = scale_ptr + g * stride_sg + offs_w[None, :] * PACK
            zp = zero_ptr + g * stride_sg + offs_w[None, :] * PACK
            o0, o1, o2, o3, o4, o5, o6, o7 = _apply_groups(o0, o1, o2, o3, o4, o5, o6, o7, a0, a1, a2, a3, a4, a5,
                                                           a6, a7, sx, sp, zp, w_mask[None, :], EVEN_W, BITS, X_EXP)
            a0 = tl.zeros((BLOCK_M, BLOCK_W), dtype=tl.float32)
            a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
            xs = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.reshape(_join_fields(o0, o1, o2, o3, o4, o5, o6, o7, BITS), (BLOCK_M, BLOCK_W * PACK))
    cols = pid_w * BLOCK_W * PACK + tl.arange(0, BLOCK_W * PACK)
    tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & (cols < N)[None, :])


def w4a16_gemv_rows(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, perm: torch.Tensor | None, bits: int, cfg: W4A16Config, block_k: int,
                    sms: int, reduce: bool = True) -> torch.Tensor:
    """x [M, K] (a few rows, cfg.block_m a program) -> [M, N] (K slices unsummed with reduce=False:
    split_k.finish); arguments checked by the caller."""
    m, k = x.shape
    pack = 32 // bits
    n = qweight.shape[1] * pack
    block_w = cfg.block_n // pack
    # The one-row GEMV's choice of K slices, counting a program per tile of block_m rows.
    split = gemv_split_k(cdiv(m, cfg.block_m), n, k, cfg, block_k, sms, pack)
    k_slice, split = slice_rows(k, block_k, split)
    out = slices_or_output(split, m, n, x.dtype, x.device)
    _w4a16_gemv_rows_kernel[(cdiv(n // pack, block_w), split, cdiv(m, cfg.block_m))](
        x, qweight, scales, zeros, qweight if perm is None else perm, out, m, n, k, k_slice,
        x.stride(0), scales.stride(0), out.stride(0), out.stride(1), STRIDE_QK=qweight.stride(0),
        GROUP=group_size, BITS=bits, HAS_PERM=perm is not None, EVEN_W=(n // pack) % block_w == 0,
        BLOCK_M=cfg.block_m, BLOCK_W=block_w, BLOCK_K=block_k, X_EXP=X_EXP,
        WORDS=max(1, min(4, block_w // (32 * cfg.num_warps))),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return finish(out, x.dtype, reduce)
