"""The two w4a16_matmul paths beside the tensor-core kernel (kernels/w4a16.py has the layout):

GEMV (one row, decode at batch 1): each weight is used once, so tensor cores buy nothing and
their operand's trip through shared memory costs. A program takes BLOCK_W words of each of
BLOCK_K rows and reduces over K inside each thread (the threads lie along N). A 4-bit field is
not shifted down: masked in place and ORed into the mantissa of 2^23 it reads, after subtracting
2^23, as q * 16^j exactly, and the activation is scaled by 16^-j instead (once per row of K,
exact). The fields above bit 20 are shifted once per word. The zero comes out of the sum,
sum_k x (q - z) = sum_k x q - z sum_k x, so the inner loop costs a mask, an OR, a subtraction
and an FMA per weight.

Dequantize, then cuBLAS (many rows): each weight tile would be widened once per row tile, and
the widening costs more than the multiply; written out once as a 16-bit [K, N] matrix it costs a
pass over the bytes, and the GEMM runs at cuBLAS's speed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv
from .w4a16_layout import W4A16Config, _input_rows, _widen


@triton.jit
def _field_sum(q, x, c, J: tl.constexpr, BITS: tl.constexpr):
    """sum over the rows of x * (field J of each word): q [BLOCK_K, W] uint32, x [BLOCK_K] float32,
    c = -2^23 x."""
    LOW: tl.constexpr = (23 - BITS) // BITS + 1  # fields that lie below the float's 23 mantissa bits
    MASK: tl.constexpr = (1 << BITS) - 1
    if J < LOW:
        bits = q & (MASK << (J * BITS))
        SHIFT: tl.constexpr = J * BITS
    else:
        bits = (q >> (LOW * BITS)) & (MASK << ((J - LOW) * BITS))
        SHIFT: tl.constexpr = (J - LOW) * BITS
    # The bits ORed into 2^23 read as 2^23 + q 2^SHIFT; x times that, plus c, is x q 2^SHIFT
    # rounded once (an FMA). The power of two comes off the column's sum.
    f = (bits | 0x4B000000).to(tl.float32, bitcast=True)
    return tl.sum(tl.fma(x[:, None], f, c[:, None]), axis=0) * (1.0 / (1 << SHIFT))


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, qw_ptr, scale_ptr, zero_ptr, perm_ptr, out_ptr, ws_ptr, count_ptr, N, K,
    stride_xm, stride_qk, stride_sg, stride_os, stride_om,
    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_PERM: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, FUSED_REDUCE: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    pid_w = tl.program_id(0)
    pid_k = tl.program_id(1)
    row = tl.program_id(2)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    w_mask = offs_w < N // PACK
    cols = offs_w[:, None] * PACK + tl.arange(0, PACK)[None, :]  # [BLOCK_W, PACK]: column order
    c_mask = w_mask[:, None] & (cols < N)
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_W, PACK), dtype=tl.float32)
    # The word pointers advance by a step's rows (no per-row 64-bit address arithmetic in the loop).
    q_ptrs = qw_ptr + (pid_k * BLOCK_K + offs_k)[:, None].to(tl.int64) * stride_qk + offs_w[None, :]
    q_step = BLOCK_K * SPLIT_K * stride_qk.to(tl.int64)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        k = k0 + offs_k  # K is a multiple of BLOCK_K: no mask
        x = tl.load(x_row + _input_rows(perm_ptr, k, HAS_PERM)).to(tl.float32)
        c = x * -8388608.0
        q = tl.load(q_ptrs, mask=w_mask[None, :], other=0).to(tl.uint32, bitcast=True)
        q_ptrs += q_step
        # The outer join's new dimension is the minor one: this nesting lists fields in order.
        if BITS == 4:
            s = tl.join(tl.join(tl.join(_field_sum(q, x, c, 0, BITS), _field_sum(q, x, c, 4, BITS)),
                                tl.join(_field_sum(q, x, c, 2, BITS), _field_sum(q, x, c, 6, BITS))),
                        tl.join(tl.join(_field_sum(q, x, c, 1, BITS), _field_sum(q, x, c, 5, BITS)),
                                tl.join(_field_sum(q, x, c, 3, BITS), _field_sum(q, x, c, 7, BITS))))
        else:
            s = tl.join(tl.join(_field_sum(q, x, c, 0, BITS), _field_sum(q, x, c, 2, BITS)),
                        tl.join(_field_sum(q, x, c, 1, BITS), _field_sum(q, x, c, 3, BITS)))
        s = tl.reshape(s, (BLOCK_W, PACK))
        g = k0 // GROUP
        scale = tl.load(scale_ptr + g * stride_sg + cols, mask=c_mask, other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + g * stride_sg + cols, mask=c_mask, other=0.0).to(tl.float32)
        acc += (s - zero * tl.sum(x, axis=0)) * scale
    if FUSED_REDUCE:
        # The K slices' partial sums meet in ws; the slice that finishes last adds them in slice
        # order (the result does not depend on timing) and resets its counter for the next call.
        tl.store(ws_ptr + pid_k * stride_os + row * N + cols, acc, mask=c_mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        counter = count_ptr + row * tl.num_programs(0) + pid_w
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.zeros((BLOCK_W, PACK), dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(ws_ptr + s * stride_os + row * N + cols, mask=c_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptr + row * stride_om + cols, total.to(out_ptr.dtype.element_ty), mask=c_mask)
            tl.atomic_xchg(counter, 0)
    else:
        tl.store(out_ptr + pid_k * stride_os + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty),
                 mask=c_mask)


def gemv_split_k(m: int, n: int, k: int, cfg: W4A16Config, block_k: int, sms: int, pack: int) -> int:
    """Slices of K for about eight warps per SM (a GEMV hides its load latency with warps, and
    one program per column tile would leave most SMs idle), each walking at least two BLOCK_K
    steps: more slices mean more float32 partial sums to add afterwards."""
    if cfg.split_k:
        return cfg.split_k
    programs = m * cdiv(n // pack, cfg.block_n // pack)
    return max(1, min(cdiv(8 * sms, cfg.num_warps * programs), k // (2 * block_k)))


# Per device: one arrival counter per (row, column tile) of a fused-reduce GEMV, zero between
# calls (the last slice resets it), made on the first eager call so that a CUDA graph only uses it.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
MAX_COUNTERS = 1 << 14


def _counters(device: torch.device) -> torch.Tensor:
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, perm: torch.Tensor | None, bits: int, cfg: W4A16Config, block_k: int,
               split: int) -> torch.Tensor:
    """x [M, K] (a few rows: one program row each) -> [M, N]; arguments checked by the caller.
    Several K slices add their float32 partial sums afterwards, in PyTorch or (cfg.fused_reduce)
    inside the kernel, by the slice that finishes last."""
    m, k = x.shape
    pack = 32 // bits
    n = qweight.shape[1] * pack
    block_w = cfg.block_n // pack
    grid = (cdiv(n // pack, block_w), split, m)
    fused = cfg.fused_reduce and split > 1 and grid[0] * m <= MAX_COUNTERS
    if split == 1:
        out = torch.empty(1, m, n, dtype=x.dtype, device=x.device)
        ws = out
    elif fused:
        out = torch.empty(1, m, n, dtype=x.dtype, device=x.device)
        ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    else:
        out = ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    _w4a16_gemv_kernel[grid](
        x, qweight, scales, zeros, qweight if perm is None else perm, out, ws,
        _counters(x.device) if fused else out, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), ws.stride(0), out.stride(1),
        GROUP=group_size, BITS=bits, HAS_PERM=perm is not None, BLOCK_W=block_w, BLOCK_K=block_k,
        SPLIT_K=split, FUSED_REDUCE=fused, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out[0] if split == 1 or fused else out.sum(dim=0).to(x.dtype)


@triton.jit
def _w4a16_dequantize_kernel(
    qw_ptr, scale_ptr, zero_ptr, out_ptr, N, stride_qk, stride_sg, stride_ok,
    GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_w = pid_n * (BLOCK_N // PACK) + tl.arange(0, BLOCK_N // PACK)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_mask = offs_w < N // PACK
    n_mask = offs_n < N
    q = tl.load(qw_ptr + k[:, None].to(tl.int64) * stride_qk + offs_w[None, :], mask=w_mask[None, :], other=0)
    g = (pid_k * BLOCK_K) // GROUP
    scale = tl.load(scale_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    w = _widen(q.to(tl.uint32, bitcast=True), BITS).to(tl.float32, bitcast=True) - (zero + 8388608.0)[None, :]
    tl.store(out_ptr + k[:, None].to(tl.int64) * stride_ok + offs_n[None, :],
             (w * scale[None, :]).to(out_ptr.dtype.element_ty), mask=n_mask[None, :])


def w4a16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                     bits: int, dtype: torch.dtype, block_k: int, block_n: int = 256) -> torch.Tensor:
    """The [K, N] weight in `dtype`, rows in qweight's order (each rounded once, as the
    tensor-core path rounds the weights it multiplies)."""
    k = qweight.shape[0]
    n = qweight.shape[1] * (32 // bits)
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    _w4a16_dequantize_kernel[(k // block_k, cdiv(n, block_n))](
        qweight, scales, zeros, out, n, qweight.stride(0), scales.stride(0), out.stride(0),
        GROUP=group_size, BITS=bits, BLOCK_K=block_k, BLOCK_N=block_n, num_warps=4,
    )
    return out


def w4a16_dequantize_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                            zeros: torch.Tensor, group_size: int, perm: torch.Tensor | None, bits: int,
                            block_k: int) -> torch.Tensor:
    """x [M, K] (many rows) -> [M, N]: the weight dequantized once, then one GEMM."""
    w = w4a16_dequantize(qweight, scales, zeros, group_size, bits, x.dtype, block_k)
    if perm is not None:
        x = x.index_select(1, perm)  # qweight's rows are sorted by group: gather x the same way
    return x @ w
