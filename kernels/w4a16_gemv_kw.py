"""The one-row GEMV with several warps along K in each program (`W4A16Config.k_warps` > 1).

The plain GEMV (kernels/w4a16_paths.py) puts a program's warps side by side along N, so a small
projection gets few warps per SM unless K is cut into many slices, and every slice adds a float32
partial row that is written, read back and summed. Here a program's column tile is repeated
k_warps times along K: sub-slice j of the program's K slice feeds "virtual columns" j * BLOCK_W
.. (j + 1) * BLOCK_W, so each warp walks a short run of K with all of its loads issued at once,
and the k_warps partial rows meet in the program (a sum over one axis, through shared memory
once) rather than in global memory. The arithmetic per weight is the plain GEMV's: a field read
in place as a float and one FFMA, the zero and scale once per group (a sub-slice lies inside one
group, or is whole groups).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv
from .split_k import finish, slices_or_output
from .w4a16_layout import W4A16Config, _input_rows
from .w4a16_paths import X_EXP, _apply_groups, _fma_fields, _join_fields, _load


@triton.jit
def _w4a16_gemv_kw_kernel(
    x_ptr, qw_ptr, scale_ptr, zero_ptr, perm_ptr, out_ptr, N, K, SUB, stride_xm, stride_sg, stride_os, stride_om,
    STRIDE_QK: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, HAS_PERM: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, K_WARPS: tl.constexpr, X_EXP: tl.constexpr,
    WORDS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_W: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    XS: tl.constexpr = 1.0 * (1 << X_EXP)
    C: tl.constexpr = K_WARPS * BLOCK_W  # virtual columns: (sub-slice, word)
    pid_w = tl.program_id(0)
    pid_k = tl.program_id(1)
    row = tl.program_id(2)
    c = tl.arange(0, C)
    offs_w = tl.max_contiguous(pid_w * BLOCK_W + c % BLOCK_W, WORDS)
    k_base = pid_k * (K_WARPS * SUB) + (c // BLOCK_W) * SUB  # each virtual column's first row
    w_mask = offs_w < N // PACK
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    offs_k = tl.arange(0, BLOCK_K)
    a0 = tl.zeros((C,), dtype=tl.float32)
    a1, a2, a3, a4, a5, a6, a7, xs = a0, a0, a0, a0, a0, a0, a0, a0
    o0, o1, o2, o3, o4, o5, o6, o7 = a0, a0, a0, a0, a0, a0, a0, a0
    rows0 = k_base[None, :] + offs_k[:, None]  # [BLOCK_K, C]: the first step's rows
    q_ptrs = qw_ptr + rows0.to(tl.int64) * STRIDE_QK + offs_w[None, :]
    for k0 in range(0, SUB, BLOCK_K):
        # Rows clamped to K, which also hides their run along K from the compiler: a load it
        # sees as contiguous there gets a layout of its own, converted through shared memory.
        rows = tl.minimum(rows0 + k0, K - 1)
        if EVEN_K:  # every K slice whole: no row past K
            qt = _load(q_ptrs + k0 * STRIDE_QK, w_mask[None, :], EVEN_W)
            xt = tl.load(x_row + _input_rows(perm_ptr, rows, HAS_PERM))
        else:
            in_k = rows0 + k0 < K
            qt = tl.load(q_ptrs + k0 * STRIDE_QK, mask=in_k & w_mask[None, :], other=0)
            xt = tl.load(x_row + _input_rows(perm_ptr, rows, HAS_PERM), mask=in_k, other=0.0)
        qt = qt.to(tl.uint32, bitcast=True)
        xt = xt.to(tl.float32) * XS
        for r in tl.static_range(BLOCK_K):
            # As in the plain GEMV, every row of a thread's words is in that thread.
            pick = offs_k[:, None] == r
            q = tl.sum(tl.where(pick, qt, 0), axis=0)
            x = tl.sum(tl.where(pick, xt, -0.0), axis=0)
            xs += x
            a0, a1, a2, a3, a4, a5, a6, a7 = _fma_fields(q, x, a0, a1, a2, a3, a4, a5, a6, a7, BITS)
        k1 = k0 + BLOCK_K
        # Sub-slices start on group boundaries or inside one group, so every virtual column
        # reaches a group's end at the same step.
        if (k1 % GROUP == 0) | (k1 >= SUB):
            g = (k_base + k0) // GROUP
            g_mask = w_mask & (k_base + k0 < K)
            sx = xs * (1.0 / XS)
            sp = scale_ptr + g * stride_sg + offs_w * PACK
            zp = zero_ptr + g * stride_sg + offs_w * PACK
            EVEN: tl.constexpr = EVEN_K and EVEN_W
            o0, o1, o2, o3, o4, o5, o6, o7 = _apply_groups(o0, o1, o2, o3, o4, o5, o6, o7, a0, a1, a2, a3, a4, a5,
                                                           a6, a7, sx, sp, zp, g_mask, EVEN, BITS, X_EXP)
            a0 = tl.zeros((C,), dtype=tl.float32)
            a1, a2, a3, a4, a5, a6, a7, xs = a0, a0, a0, a0, a0, a0, a0, a0
    # [C, PACK] -> the sub-slices' rows added: [BLOCK_W, PACK] in column order.
    acc = tl.sum(tl.reshape(_join_fields(o0, o1, o2, o3, o4, o5, o6, o7, BITS), (K_WARPS, BLOCK_W, PACK)), axis=0)
    w_out = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    cols = w_out[:, None] * PACK + tl.arange(0, PACK)[None, :]
    tl.store(out_ptr + pid_k * stride_os + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty),
             mask=cols < N)


def sub_slice_rows(k: int, group_size: int, block_k: int, cfg: W4A16Config, programs: int, sms: int) -> int:
    """Rows a warp walks: from the config's K slices, or (split_k 0) for about eight warps per SM;
    then a multiple of block_k that divides the group or is whole groups, so that group ends
    fall on the same step in every sub-slice."""
    if cfg.split_k:
        sub = cdiv(k, cfg.split_k * cfg.k_warps)
    else:
        slices = max(1, cdiv(8 * sms, cfg.num_warps * programs))
        sub = cdiv(k, slices * cfg.k_warps)
    sub = cdiv(sub, block_k) * block_k
    if sub >= group_size:
        return cdiv(sub, group_size) * group_size
    while group_size % sub:
        sub += block_k
    return sub


def w4a16_gemv_kw(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int, perm: torch.Tensor | None, bits: int, cfg: W4A16Config, block_k: int,
                  sms: int) -> torch.Tensor:
    """x [M, K] (a few rows: one program row each) -> [M, N]; arguments checked by the caller."""
    m, k = x.shape
    pack = 32 // bits
    n = qweight.shape[1] * pack
    block_w = cfg.block_n // pack
    programs = m * cdiv(n // pack, block_w)
    sub = sub_slice_rows(k, group_size, block_k, cfg, programs, sms)
    split = cdiv(k, cfg.k_warps * sub)
    out = slices_or_output(split, m, n, x.dtype, x.device)
    _w4a16_gemv_kw_kernel[(cdiv(n // pack, block_w), split, m)](
        x, qweight, scales, zeros, qweight if perm is None else perm, out, n, k, sub,
        x.stride(0), scales.stride(0), out.stride(0), out.stride(1), STRIDE_QK=qweight.stride(0),
        GROUP=group_size, BITS=bits, HAS_PERM=perm is not None, BLOCK_W=block_w, BLOCK_K=block_k,
        K_WARPS=cfg.k_warps, X_EXP=X_EXP,
        WORDS=max(1, min(4, cfg.k_warps * block_w // (32 * cfg.num_warps))),
        EVEN_K=k % (cfg.k_warps * sub) == 0, EVEN_W=(n // pack) % block_w == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return finish(out, x.dtype)
