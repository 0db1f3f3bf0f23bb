"""W4A16 matmul on 4-bit words repacked into wgmma's A-fragment order (Marlin's idea, in
triton.language): out = x @ dequant(W)^T computed as out^T = W^T x^T, the widened weight tile
going from the words' registers straight into the MMA's register operand.

The shipped layout (kernels/w4a16.py) packs eight columns of one K row in a word, so a widened
tile must be redistributed before the MMA: the sm_90 build sends it through shared memory every
K step. Here `repack_fragment` reorders each [64 N x 64 K] slab at load so that thread t of a
warpgroup loads, in four contiguous words, exactly the 32 values of its wgmma A fragment:

    t = warp * 32 + g * 4 + tid,  value i = kstep * 8 + khalf * 4 + rowhalf * 2 + pair  holds
    n = warp * 16 + rowhalf * 8 + g,  k = kstep * 16 + khalf * 8 + tid * 2 + pair,  and sits in
    word kstep, field pair * 4 + khalf * 2 + rowhalf

so one of the MMA's 32-bit registers (a pair) is fields r and r + 4 of a word: bits 0-3 and 16-19
after a shift by 4r. On a GPU one AND-OR (lop3) per register then makes both values 16-bit floats
at once (the magic exponent of 128, or 1024 in fp16, over the field's bits), and two paired
FMAs subtract the zero and apply the scale: about two instructions a weight, where widening one
value at a time in float32 takes four times that. The interpreter widens the same fields with
triton.language. The values are then reshaped and permuted into the [64 * SLABS, 64] tile
(Triton's layouts follow without moving data: the sm_90 loop has no shared-memory store) and
multiplied by x^T, whose tile is in shared memory. Each thread holds two columns, so a group's
zero and scale cost a few instructions a thread, not one a weight. Words are stored
[K / 64, N / 64, 128, 4]: the slabs of one K step are adjacent, so a program of SLABS slabs
loads one contiguous run. 4-bit fields only, N and K multiples of 64, groups of 64 or more.

The engine repacks a weight into this layout only on a card whose measured table has its shape
(kernels/w4a16_fragment_layout.py); kernels/w4a16_fragment_paths.py picks this kernel or a
dequantize-then-GEMM per row bucket.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, check_runnable, num_sms
from .split_k import finish, slices_or_output
from .w4a16_fragment_layout import (OP, SLAB, FragmentConfig, check_arguments, fragment_order,  # noqa: F401
                                    repack_fragment, unpack_fragment)
from .w4a16_layout import _input_rows, _widen

# Four registers of two 16-bit values from one word, `$8`: register r is fields r and r + 4 over
# the magic exponent (AND-OR with the mask, in one lop3), then (v - (magic + zero)) * scale as
# paired FMAs (x * 1 + c, x * s + -0: both round once, as a subtraction and a product would).
# Registers 0 and 2 hold the thread's first column (zero $9, scale $10), 1 and 3 its second
# ($11, $12), each the value twice.
_PAIRED_DEQUANT = """{
.reg .b32 r0, r1, r2, r3, sh, one, nz;
mov.b32 one, ONE;
mov.b32 nz, 0x80008000;
lop3.b32 r0, $8, 0x000f000f, MAGIC, 0xea;
shr.u32 sh, $8, 4;
lop3.b32 r1, sh, 0x000f000f, MAGIC, 0xea;
shr.u32 sh, $8, 8;
lop3.b32 r2, sh, 0x000f000f, MAGIC, 0xea;
shr.u32 sh, $8, 12;
lop3.b32 r3, sh, 0x000f000f, MAGIC, 0xea;
fma.rn.TYPE r0, r0, one, $9;
fma.rn.TYPE r1, r1, one, $11;
fma.rn.TYPE r2, r2, one, $9;
fma.rn.TYPE r3, r3, one, $11;
fma.rn.TYPE r0, r0, $10, nz;
fma.rn.TYPE r1, r1, $12, nz;
fma.rn.TYPE r2, r2, $10, nz;
fma.rn.TYPE r3, r3, $12, nz;
mov.b32 {$0, $1}, r0;
mov.b32 {$2, $3}, r1;
mov.b32 {$4, $5}, r2;
mov.b32 {$6, $7}, r3;
}"""
_PAIRED_BF16 = tl.constexpr(_PAIRED_DEQUANT.replace("ONE", "0x3f803f80").replace("MAGIC", "0x43004300")
                            .replace("TYPE", "bf16x2"))
_PAIRED_FP16 = tl.constexpr(_PAIRED_DEQUANT.replace("ONE", "0x3c003c00").replace("MAGIC", "0x64006400")
                            .replace("TYPE", "f16x2"))


@triton.jit
def _twice(v, DTYPE: tl.constexpr):
    """v rounded to DTYPE, its 16 bits in both halves of an int32."""
    h = v.to(DTYPE).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return h | (h << 16)


@triton.jit
def _paired_constants(zero_ptrs, scale_ptrs, DTYPE: tl.constexpr):
    """Each thread's -(magic + zero) and scale for its two columns (zero_ptrs and scale_ptrs point
    at the first; the second is 8 further on), each value twice in an int32."""
    magic = 128.0 if DTYPE == tl.bfloat16 else 1024.0
    # magic + zero is exact in 16 bits for the integer zeros 0..15 every 4-bit format stores.
    nz0 = _twice(-(magic + tl.load(zero_ptrs).to(tl.float32)), DTYPE)
    nz1 = _twice(-(magic + tl.load(zero_ptrs + 8).to(tl.float32)), DTYPE)
    s0 = _twice(tl.load(scale_ptrs).to(tl.float32), DTYPE)
    s1 = _twice(tl.load(scale_ptrs + 8).to(tl.float32), DTYPE)
    return nz0, s0, nz1, s1


@triton.jit
def _dequant_paired(q, nz0, s0, nz1, s1, DTYPE: tl.constexpr, SLABS: tl.constexpr):
    """Words [128 * SLABS, 4] (thread t's four) -> the [64 * SLABS, 64] tile in DTYPE, through
    _PAIRED_DEQUANT (GPU only: inline PTX), with _paired_constants' values."""
    nz0 = tl.broadcast_to(nz0[:, None], q.shape)
    nz1 = tl.broadcast_to(nz1[:, None], q.shape)
    s0 = tl.broadcast_to(s0[:, None], q.shape)
    s1 = tl.broadcast_to(s1[:, None], q.shape)
    if DTYPE == tl.bfloat16:
        o = tl.inline_asm_elementwise(_PAIRED_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r", [q, nz0, s0, nz1, s1],
                                      dtype=(tl.int16,) * 8, is_pure=True, pack=1)
    else:
        o = tl.inline_asm_elementwise(_PAIRED_FP16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r", [q, nz0, s0, nz1, s1],
                                      dtype=(tl.int16,) * 8, is_pure=True, pack=1)
    # o[r * 2 + pair], r = khalf * 2 + rowhalf -> [t, kstep, pair, rowhalf, khalf]
    v = tl.join(tl.join(tl.join(o[0], o[1]), tl.join(o[2], o[3])), tl.join(tl.join(o[4], o[5]), tl.join(o[6], o[7])))
    # (warps, g, tid, kstep, pair, rowhalf, khalf) -> [n, k]
    v = tl.reshape(v, (4 * SLABS, 8, 4, 4, 2, 2, 2))
    v = tl.reshape(tl.permute(v, (0, 5, 1, 3, 6, 2, 4)), (64 * SLABS, 64))
    return v.to(DTYPE, bitcast=True)


@triton.jit
def _widen_fragment(q, SLABS: tl.constexpr):
    """Words [128 * SLABS, 4] -> the [64 * SLABS, 64] tile of 2^23 + q as float32 (triton.language:
    any device, the interpreter included)."""
    v = _widen(q.to(tl.uint32, bitcast=True), 4).to(tl.float32, bitcast=True)
    # (warps, g, tid, kstep, pair, khalf, rowhalf) -> [n, k]: the fragment's own order
    v = tl.reshape(v, (4 * SLABS, 8, 4, 4, 2, 2, 2))
    return tl.reshape(tl.permute(v, (0, 6, 1, 3, 5, 2, 4)), (64 * SLABS, 64))


@triton.jit
def _fragment_dequantize_kernel(q_ptr, scale_ptr, zero_ptr, out_ptr, N, stride_sg, stride_on, GROUP: tl.constexpr):
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    t = tl.arange(0, 128)
    q = tl.load(q_ptr + (pid_k * (N // 64) + pid_n).to(tl.int64) * 512 + t[:, None] * 4 + tl.arange(0, 4)[None, :])
    offs_n = pid_n * 64 + tl.arange(0, 64)
    g = (pid_k * 64) // GROUP
    zero = tl.load(zero_ptr + g * stride_sg + offs_n).to(tl.float32) + 8388608.0
    scale = tl.load(scale_ptr + g * stride_sg + offs_n).to(tl.float32)
    w = (_widen_fragment(q, 1) - zero[:, None]) * scale[:, None]
    offs_k = pid_k * 64 + tl.arange(0, 64)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :], w.to(out_ptr.dtype.element_ty))

@triton.jit
def _step_tile(q_ptr, kj, N, pid_n, t, wd, nz0, s0, nz1, s1, zero, scale, DTYPE: tl.constexpr, SLABS: tl.constexpr,
               PAIRED: tl.constexpr):
    """The [64 * SLABS, 64] tile in DTYPE of the K step at kj: the paired PTX's constants or the
    float32 widening's zero and scale (whichever PAIRED uses; the others are ignored)."""
    words = q_ptr + ((kj // 64) * (N // 64) + pid_n * SLABS).to(tl.int64) * 512 + t[:, None] * 4 + wd[None, :]
    q = tl.load(words)
    if PAIRED:
        w = _dequant_paired(q, nz0, s0, nz1, s1, DTYPE, SLABS)
    else:
        w = ((_widen_fragment(q, SLABS) - zero[:, None]) * scale[:, None]).to(DTYPE)
    return w


@triton.jit
def _w4a16_fragment_kernel(
    x_ptr, q_ptr, scale_ptr, zero_ptr, perm_ptr, out_ptr, M, N, K,
    stride_xm, stride_sg, stride_os, stride_om,
    GROUP: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_M: tl.constexpr, SLABS: tl.constexpr,
    SPLIT_K: tl.constexpr, KSTEPS: tl.constexpr, PAIRED: tl.constexpr,
):
    BLOCK_N: tl.constexpr = 64 * SLABS  # (SLAB: a slab of 64 columns, a K step of 64)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    t = tl.arange(0, 128 * SLABS)
    wd = tl.arange(0, 4)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, 64 * KSTEPS)
    # Each thread's first column (rowhalf 0); its second is 8 further on.
    n_of_t = pid_n * BLOCK_N + (t // 32) * 16 + (t // 4) % 8
    m_mask = offs_m < M
    # Rows past M read row M - 1 again (their sums are never stored): the loop's loads need no mask.
    x_rows = x_ptr + tl.minimum(offs_m, M - 1)[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # Each iteration takes KSTEPS steps of 64 from one group, so its zeros and scales load once.
    for k0 in range(pid_k * 64 * KSTEPS, K, 64 * KSTEPS * SPLIT_K):
        g = k0 // GROUP
        if PAIRED:
            nz0, s0, nz1, s1 = _paired_constants(zero_ptr + g * stride_sg + n_of_t, scale_ptr + g * stride_sg + n_of_t,
                                                 x_ptr.dtype.element_ty)
            # unused here: _step_tile takes either widening's constants
            zero = nz0
            scale = nz0
        else:
            # 2^23 + q - (2^23 + zero) = q - zero exactly (the fields read as floats: see _widen).
            zero = tl.load(zero_ptr + g * stride_sg + offs_n).to(tl.float32) + 8388608.0
            scale = tl.load(scale_ptr + g * stride_sg + offs_n).to(tl.float32)
            nz0 = zero  # unused here, as above
            s0 = zero
            nz1 = zero
            s1 = zero
        # One dot an iteration over all KSTEPS steps: a second dot chained on the first's result
        # makes Triton wait for the first before going on, so no MMA overlaps the next widening.
        w = _step_tile(q_ptr, k0, N, pid_n, t, wd, nz0, s0, nz1, s1, zero, scale, x_ptr.dtype.element_ty, SLABS, PAIRED)
        if KSTEPS >= 2:
            w1 = _step_tile(q_ptr, k0 + 64, N, pid_n, t, wd, nz0, s0, nz1, s1, zero, scale, x_ptr.dtype.element_ty,
                            SLABS, PAIRED)
            if KSTEPS == 4:
                w2 = _step_tile(q_ptr, k0 + 128, N, pid_n, t, wd, nz0, s0, nz1, s1, zero, scale,
                                x_ptr.dtype.element_ty, SLABS, PAIRED)
                w3 = _step_tile(q_ptr, k0 + 192, N, pid_n, t, wd, nz0, s0, nz1, s1, zero, scale,
                                x_ptr.dtype.element_ty, SLABS, PAIRED)
                # [n, k, i, o] holds step o * 2 + i
                w = tl.reshape(tl.permute(tl.join(tl.join(w, w1), tl.join(w2, w3)), (0, 3, 2, 1)), (BLOCK_N, 256))
            else:
                w = tl.reshape(tl.permute(tl.join(w, w1), (0, 2, 1)), (BLOCK_N, 128))
        x = tl.load(x_rows + _input_rows(perm_ptr, k0 + kk, HAS_PERM)[None, :])
        acc = tl.dot(w, tl.trans(x), acc)
    out = out_ptr + pid_k * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[None, :])


def paired_dequant(x: torch.Tensor) -> bool:
    """Whether the kernel widens with the paired PTX (a GPU) or with triton.language (the interpreter)."""
    return x.is_cuda


def choose_split_k(m: int, n: int, k: int, cfg: FragmentConfig, sms: int) -> int:
    """Slices of K so that about two programs run per SM, each still walking at least four steps."""
    if cfg.split_k:
        return cfg.split_k
    programs = cdiv(n, SLAB * cfg.slabs) * cdiv(m, cfg.block_m)
    return max(1, min(cdiv(2 * sms, programs), k // (4 * SLAB * cfg.ksteps)))


def w4a16_fragment_matmul(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          group_size: int, perm: torch.Tensor | None = None, *, reduce: bool = True,
                          config: FragmentConfig | None = None) -> torch.Tensor:
    """x [M, K] bf16/fp16, words from `repack_fragment`, scales and zeros [K / group_size, N]
    (weight[n, k] = (q - zeros[g, n]) * scales[g, n], as in kernels/w4a16.py), perm [K] int32 or
    None (act-order's gather) -> out [M, N] in x's dtype."""
    cfg = config or FragmentConfig()
    m, n, k = check_arguments(x, words, scales, zeros, group_size, perm, cfg)
    check_runnable(OP, x)
    if m == 0:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    split = choose_split_k(m, n, k, cfg, num_sms(x.device))
    out = slices_or_output(split, m, n, x.dtype, x.device)
    grid = (n // (SLAB * cfg.slabs), cdiv(m, cfg.block_m), split)
    _w4a16_fragment_kernel[grid](
        x, words, scales, zeros, words if perm is None else perm, out, m, n, k,
        x.stride(0), scales.stride(0), out.stride(0), out.stride(1),
        GROUP=group_size, HAS_PERM=perm is not None, BLOCK_M=cfg.block_m, SLABS=cfg.slabs, SPLIT_K=split, KSTEPS=cfg.ksteps,
        PAIRED=paired_dequant(x), num_warps=4 * cfg.slabs, num_stages=cfg.num_stages,
    )
    return finish(out, x.dtype, reduce)


def fragment_dequantize(words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight in `dtype` (columns in the words' K order), each value rounded once."""
    k, n = words.shape[0] * SLAB, words.shape[1] * SLAB
    out = torch.empty(n, k, dtype=dtype, device=words.device)
    _fragment_dequantize_kernel[(k // SLAB, n // SLAB)](words, scales, zeros, out, n, scales.stride(0), out.stride(0),
                                                        GROUP=group_size, num_warps=4)
    return out

