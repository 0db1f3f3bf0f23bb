"""The two w4a16_matmul paths beside the tensor-core kernel (kernels/w4a16.py has the layout):

GEMV (one row, decode at batch 1): each weight is used once, so tensor cores buy nothing and
their operand's trip through shared memory costs. A program takes BLOCK_W words, the threads
along N each holding every row of its words, and walks a run of K rows BLOCK_K at a time, the
next step's tile loaded before this one is used. A field becomes a float in one instruction
and with no offset to take off: left in place (masked, or the top field shifted down), its bits
read as the float32 q 2^(shift - 149) exactly (any pattern below bit 24 is a denormal or one of
the smallest normals, all multiples of 2^-149), and the activation, scaled by 2^64 so that the
products are normal floats, multiplies it into the field's running sum in one FFMA. The zero
and the scale apply once per group, sum_k x (q - z) s = s (sum_k x q - z sum_k x). So a weight
costs an AND or a shift and an FFMA, if denormals are kept (no flush to zero: Triton's float32
arithmetic keeps them, and tests/kernels/test_kernel_w4a16_hopper.py checks the sm_90 build).

Dequantize, then cuBLAS (many rows): each weight tile would be widened once per row tile, and
the widening costs more than the multiply; written out once as a 16-bit [K, N] matrix it costs a
pass over the bytes, and the GEMM runs at cuBLAS's speed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv
from .split_k import sum_slices
from .w4a16_layout import W4A16Config, _input_rows, _load, _widen


# The activations are scaled by 2^X_EXP so that their product with a field (the field's bits in
# place, read as the float32 q 2^(shift - 149)) is a normal float for |x q| >= 2^-41, and stays
# finite for |x| < 2^64 (fp16 activations always, bf16 in any model that does not overflow).
X_EXP = 64


@triton.jit
def _field(q, J: tl.constexpr, BITS: tl.constexpr):
    """Field J of each word as a float32 whose bits are that field alone (one instruction). Any
    pattern below bit 24 (exponent field 0 or 1) reads as exactly pattern * 2^-149, so the fields
    below bit 24 are masked in place and the top one shifted down. A 4-bit word's seventh field
    is the top byte shifted down, so it holds field 6 + 16 * field 7; the kernel takes the
    seventh field's sum off once per group."""
    if J == 32 // BITS - 1:
        bits = q >> (32 - BITS)
    elif J < 24 // BITS:
        bits = q & (((1 << BITS) - 1) << (J * BITS))
    else:
        bits = q >> 24
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _gemv_tile(q_ptrs, x_row, perm_ptr, k0, offs_k, w_mask, STRIDE_QK: tl.constexpr, HAS_PERM: tl.constexpr,
               EVEN_W: tl.constexpr, XS: tl.constexpr):
    """The words of rows k0.. of a step and their activations, times XS, in float32."""
    q = _load(q_ptrs + k0.to(tl.int64) * STRIDE_QK, w_mask[None, :], EVEN_W).to(tl.uint32, bitcast=True)
    x = tl.load(x_row + _input_rows(perm_ptr, k0 + offs_k, HAS_PERM)).to(tl.float32) * XS
    return q, x


@triton.jit
def _apply_group(out, acc, sx, scale_ptrs, zero_ptrs, mask, EVEN: tl.constexpr, J: tl.constexpr,
                 BITS: tl.constexpr, X_EXP: tl.constexpr):
    """out + (sum_k x q - zero sum_k x) * scale for field J over one group: acc holds
    sum_k x q 2^(X_EXP + shift - 149), sx sum_k x."""
    SHIFT: tl.constexpr = J * BITS * (J < 24 // BITS)  # the field's lowest bit in _field's float
    UNSCALE: tl.constexpr = 1.0 * (1 << (149 - X_EXP - SHIFT))
    scale = _load(scale_ptrs + J, mask, EVEN).to(tl.float32)
    zero = _load(zero_ptrs + J, mask, EVEN).to(tl.float32)
    return out + (acc * UNSCALE - zero * sx) * scale


@triton.jit
def _fma_fields(q, x, a0, a1, a2, a3, a4, a5, a6, a7, BITS: tl.constexpr):
    """Each field's running sum of field x x for one row of words (one FFMA a field)."""
    a0 = tl.fma(_field(q, 0, BITS), x, a0)
    a1 = tl.fma(_field(q, 1, BITS), x, a1)
    a2 = tl.fma(_field(q, 2, BITS), x, a2)
    a3 = tl.fma(_field(q, 3, BITS), x, a3)
    if BITS == 4:
        a4 = tl.fma(_field(q, 4, BITS), x, a4)
        a5 = tl.fma(_field(q, 5, BITS), x, a5)
        a6 = tl.fma(_field(q, 6, BITS), x, a6)
        a7 = tl.fma(_field(q, 7, BITS), x, a7)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _apply_groups(o0, o1, o2, o3, o4, o5, o6, o7, a0, a1, a2, a3, a4, a5, a6, a7, sx, sp, zp, mask,
                  EVEN: tl.constexpr, BITS: tl.constexpr, X_EXP: tl.constexpr):
    """_apply_group for every field of a group's end."""
    o0 = _apply_group(o0, a0, sx, sp, zp, mask, EVEN, 0, BITS, X_EXP)
    o1 = _apply_group(o1, a1, sx, sp, zp, mask, EVEN, 1, BITS, X_EXP)
    o2 = _apply_group(o2, a2, sx, sp, zp, mask, EVEN, 2, BITS, X_EXP)
    o3 = _apply_group(o3, a3, sx, sp, zp, mask, EVEN, 3, BITS, X_EXP)
    if BITS == 4:
        a6 -= 16.0 * a7  # a6 summed field 6 + 16 * field 7 (see _field)
        o4 = _apply_group(o4, a4, sx, sp, zp, mask, EVEN, 4, BITS, X_EXP)
        o5 = _apply_group(o5, a5, sx, sp, zp, mask, EVEN, 5, BITS, X_EXP)
        o6 = _apply_group(o6, a6, sx, sp, zp, mask, EVEN, 6, BITS, X_EXP)
        o7 = _apply_group(o7, a7, sx, sp, zp, mask, EVEN, 7, BITS, X_EXP)
    return o0, o1, o2, o3, o4, o5, o6, o7


@triton.jit
def _join_fields(o0, o1, o2, o3, o4, o5, o6, o7, BITS: tl.constexpr):
    """[W] per field -> [W, 32 / BITS], fields in column order (the outer join's new dimension
    is the minor one: this nesting lists them in order)."""
    if BITS == 4:
        acc = tl.join(tl.join(tl.join(o0, o4), tl.join(o2, o6)), tl.join(tl.join(o1, o5), tl.join(o3, o7)))
    else:
        acc = tl.join(tl.join(o0, o2), tl.join(o1, o3))
    return acc


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, qw_ptr, scale_ptr, zero_ptr, perm_ptr, out_ptr, ws_ptr, count_ptr, N, K, K_SLICE,
    stride_xm, stride_sg, stride_os, stride_om,
    STRIDE_QK: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, HAS_PERM: tl.constexpr,
    EVEN_W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    FUSED_REDUCE: tl.constexpr, X_EXP: tl.constexpr, WORDS: tl.constexpr, X_CHUNK: tl.constexpr,
    AHEAD: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    XS: tl.constexpr = 1.0 * (1 << X_EXP)
    pid_w = tl.program_id(0)
    pid_k = tl.program_id(1)
    row = tl.program_id(2)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    # Each thread's words are contiguous up to WORDS (one load each row, up to 16 bytes), so all
    # threads lie along N even when a tile has fewer than four words a thread.
    offs_w = tl.max_contiguous(offs_w, WORDS)
    w_mask = offs_w < N // PACK
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    offs_k = tl.arange(0, BLOCK_K)
    q_ptrs = qw_ptr + offs_k[:, None] * STRIDE_QK + offs_w[None, :]
    k_lo = pid_k * K_SLICE  # this program's rows of K: a run of whole K steps
    k_hi = tl.minimum(k_lo + K_SLICE, K)
    o0 = tl.zeros((BLOCK_W,), dtype=tl.float32)
    o1, o2, o3, o4, o5, o6, o7 = o0, o0, o0, o0, o0, o0, o0
    a0, a1, a2, a3, a4, a5, a6, a7 = o0, o0, o0, o0, o0, o0, o0, o0
    # The tiles of the next AHEAD steps are loading while a step computes (past the slice's end
    # a step loads the last one again), so a warp keeps loads in flight. ptxas issues them late
    # in the step before; two ahead leave a whole step more to cover the latency.
    last = k_hi - BLOCK_K
    qt, xt = _gemv_tile(q_ptrs, x_row, perm_ptr, k_lo, offs_k, w_mask, STRIDE_QK, HAS_PERM, EVEN_W, XS)
    if AHEAD == 2:
        q1, x1 = _gemv_tile(q_ptrs, x_row, perm_ptr, tl.minimum(k_lo + BLOCK_K, last), offs_k, w_mask,
                            STRIDE_QK, HAS_PERM, EVEN_W, XS)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        qn, xn = _gemv_tile(q_ptrs, x_row, perm_ptr, tl.minimum(k0 + AHEAD * BLOCK_K, last), offs_k, w_mask,
                            STRIDE_QK, HAS_PERM, EVEN_W, XS)
        xt = tl.broadcast_to(xt[:, None], (BLOCK_K, BLOCK_W))
        for r in tl.static_range(BLOCK_K):
            # Each thread holds every row of its words: picking row r out (a sum over a one-hot
            # mask) costs no instruction, and a group's sums per field stay in those threads.
            pick = offs_k[:, None] == r
            q = tl.sum(tl.where(pick, qt, 0), axis=0)
            x = tl.sum(tl.where(pick, xt, -0.0), axis=0)
            a0, a1, a2, a3, a4, a5, a6, a7 = _fma_fields(q, x, a0, a1, a2, a3, a4, a5, a6, a7, BITS)
        if AHEAD == 2:
            qt, xt, q1, x1 = q1, x1, qn, xn
        else:
            qt, xt = qn, xn
        k1 = k0 + BLOCK_K
        if (k1 % GROUP == 0) | (k1 >= k_hi):  # a group's end: its zero and scale apply once
            g = k0 // GROUP
            sx = tl.zeros((), dtype=tl.float32)
            for kc in range(tl.maximum(g * GROUP, k_lo), k1, X_CHUNK):  # the group's rows in this slice
                kx = kc + tl.arange(0, X_CHUNK)
                # Rows past the step are clamped, not only masked: a slice that starts inside a
                # group would otherwise read act-order's permutation past its end.
                rows = _input_rows(perm_ptr, tl.minimum(kx, k1 - 1), HAS_PERM)
                sx += tl.sum(tl.load(x_row + rows, mask=kx < k1, other=0.0).to(tl.float32), axis=0)
            sp = scale_ptr + g * stride_sg + offs_w * PACK
            zp = zero_ptr + g * stride_sg + offs_w * PACK
            o0, o1, o2, o3, o4, o5, o6, o7 = _apply_groups(o0, o1, o2, o3, o4, o5, o6, o7, a0, a1, a2, a3, a4, a5,
                                                           a6, a7, sx, sp, zp, w_mask, EVEN_W, BITS, X_EXP)
            a0 = tl.zeros((BLOCK_W,), dtype=tl.float32)
            a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
    acc = tl.reshape(_join_fields(o0, o1, o2, o3, o4, o5, o6, o7, BITS), (BLOCK_W, PACK))
    cols = offs_w[:, None] * PACK + tl.arange(0, PACK)[None, :]  # [BLOCK_W, PACK]: column order
    c_mask = cols < N
    if FUSED_REDUCE:
        # The K slices' partial sums meet in ws; the slice that finishes last adds them in slice
        # order (the result does not depend on timing) and resets its counter for the next call.
        tl.store(ws_ptr + pid_k * stride_os + row * N + cols, acc, mask=c_mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        counter = count_ptr + row * tl.num_programs(0) + pid_w
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
            # Eight slices' loads are issued before their sum: one at a time, each waits a trip
            # to L2, and a slice count in the dozens made the last program the kernel's tail.
            total = tl.zeros((BLOCK_W, PACK), dtype=tl.float32)
            for s0 in range(0, SPLIT_K, 8):
                for j in tl.static_range(8):
                    total += tl.load(ws_ptr + (s0 + j) * stride_os + row * N + cols,
                                     mask=c_mask & (s0 + j < SPLIT_K), other=0.0, cache_modifier=".cg")
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


def slice_rows(k: int, block_k: int, split: int) -> tuple[int, int]:
    """Rows of K a slice walks (whole BLOCK_K steps) for about split slices, and the slices that
    then cover K, none left without rows."""
    k_slice = cdiv(k // block_k, split) * block_k
    return k_slice, cdiv(k, k_slice)


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
               split: int, reduce: bool = True) -> torch.Tensor:
    """x [M, K] (a few rows: one program row each) -> [M, N]; arguments checked by the caller.
    Several K slices add their float32 partial sums afterwards, in one more launch or
    (cfg.fused_reduce) inside the kernel, by the slice that finishes last; or, with reduce=False
    and no fused sum, come back unsummed [S, M, N] for the next kernel to add."""
    m, k = x.shape
    pack = 32 // bits
    n = qweight.shape[1] * pack
    block_w = cfg.block_n // pack
    k_slice, split = slice_rows(k, block_k, split)
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
        _counters(x.device) if fused else out, n, k, k_slice,
        x.stride(0), scales.stride(0), ws.stride(0), out.stride(1), STRIDE_QK=qweight.stride(0),
        GROUP=group_size, BITS=bits, HAS_PERM=perm is not None, EVEN_W=(n // pack) % block_w == 0,
        BLOCK_W=block_w, BLOCK_K=block_k, SPLIT_K=split, FUSED_REDUCE=fused, X_EXP=X_EXP,
        WORDS=max(1, min(4, block_w // (32 * cfg.num_warps))), X_CHUNK=min(triton.next_power_of_2(group_size), 128),
        AHEAD=cfg.prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split == 1 or fused:
        return out[0]
    return sum_slices(ws, x.dtype) if reduce else ws


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
