"""W4A16 (and W8A16) matmul: out = x @ dequant(qweight)^T for 4-bit AWQ / GPTQ weights, with
16-bit activations. One kernel serves every batch size; a config per row count picks the tile.

Layout (backend/layers/int4.py repacks AWQ and GPTQ checkpoints into it at load):
  qweight [K, N * bits / 32] int32: packed along the output dimension, column n of row k in bits
          (n % P) * bits of word [k, n // P] (P = 32 / bits values a word, in order)
  scales, zeros [K / group_size, N]: weight[n, k] = (q[k, n] - zeros[g, n]) * scales[g, n],
          g = k // group_size (zeros hold integers: GPTQ's +1 is applied at load)
  perm [K] int32 or None: row k of qweight multiplies x[:, perm[k]]. GPTQ's desc_act puts input
          channels of one group anywhere; sorting the rows by group makes groups contiguous again,
          and the activations are gathered in the same order as they are loaded.

Packing along N lets a [BLOCK_K, BLOCK_N / P] tile of words be loaded once, in contiguous runs,
and widened in registers: each word's P fields are cut with constant shifts and joined into a new
minor dimension (inside each thread: no data moves between threads). A field becomes a float
with the 2^23 trick (its bits OR 0x4B000000 read as float32 are 2^23 + q; subtracting 2^23 + zero
is exact), so no integer-to-float conversion runs per weight; q - zero is a small integer, exact
in bf16 and fp16. BLOCK_K divides the group size, so one group's scales serve a K step: a 16-row
tile multiplies the step's float32 sums by them (8x fewer products than weights), larger tiles
multiply the weights before the dot (rounded once to the activations' dtype), so the wgmma
accumulator is not touched between steps.

Few rows (decode): one 16-row tile holds all of them, so each weight word is read once; K is cut
in SPLIT_K slices so that about two programs run per SM, the slices' float32 partial sums reduced
in a fixed order afterwards, with the cast, in one small kernel (no atomics: the result does not
depend on timing). Many rows
(prefill): 64- or 128-row tiles, grouped along M so neighbouring programs share weight tiles in L2.
One row (decode at batch 1) and many rows take other paths, chosen by the config's `method`
(kernels/w4a16_paths.py): a GEMV on the CUDA cores, and dequantize-then-cuBLAS. A table of
measured configs per GPU, weight shape and row bucket (kernels/configs/w4a16.json, written by
benchmarks/kernels/w4a16.py --write-configs) overrides the defaults.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import validation, validation_ops
from . import w4a16_gemv_rows as gemv_rows
from . import w4a16_paths as paths
from ._launch import cdiv, check_runnable, num_sms
from ._tuned import device_name, load_table
from .split_k import finish, slices_or_output
from .w4a16_layout import METHODS, W4A16Config, _input_rows, _load, _widen  # noqa: F401 (W4A16Config, METHODS: public here)

OP = "w4a16_matmul"
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)
# Row buckets: a config per bucket (each a Triton specialization, compiled once).
ROW_BUCKETS = (1, 8, 16, 64, 256, 1024)  # and "more"


DEFAULT_CONFIGS = {
    1: W4A16Config(1, 512, 16, 0, 1, 1, 1, method="gemv"),
    8: W4A16Config(16, 64, 128, 0, 1, 4, 4),  # 2-8 rows: a bucket of its own for the several-row GEMV
    16: W4A16Config(16, 64, 128, 0, 1, 4, 4),
    64: W4A16Config(64, 64, 128, 0, 8, 4, 4),
    256: W4A16Config(64, 128, 64, 0, 8, 4, 4, method="dequant"),
    # 257-1024 rows (a short prompt's prefill, workload B's TTFT): a bucket of its own, so that
    # a kernel widening each weight a few times can win there without serving long prefills.
    1024: W4A16Config(128, 128, 64, 1, 8, 8, 3, method="dequant"),
    0: W4A16Config(128, 128, 64, 1, 8, 8, 3, method="dequant"),  # more than 1024 rows
}

TUNED_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "w4a16.json")


def row_bucket(m: int) -> int:
    """The smallest bucket holding m rows, 0 for more than the largest."""
    return next((b for b in ROW_BUCKETS if m <= b), 0)


def config_key(n: int, k: int, bits: int, group_size: int, bucket: int) -> str:
    return f"{n}x{k}/w{bits}g{group_size}/m{bucket or 'big'}"


def load_tuned_configs(path: str = TUNED_CONFIGS) -> dict[str, dict[str, W4A16Config]]:
    """{GPU name: {config_key: config}} from the table; empty when there is none."""
    return load_table(path, W4A16Config)


def choose_config(m: int, n: int, k: int, bits: int, group_size: int, device: torch.device
                  ) -> W4A16Config:
    bucket = row_bucket(m)
    table = load_tuned_configs(TUNED_CONFIGS).get(device_name(device), {})
    return table.get(config_key(n, k, bits, group_size, bucket), DEFAULT_CONFIGS[bucket])


def block_k_for(cfg: W4A16Config, group_size: int) -> int:
    """The config's K step, shrunk to divide the group size (one group per step)."""
    bk = cfg.block_k
    while bk > 16 and group_size % bk:
        bk //= 2
    return bk


def choose_split_k(m: int, n: int, k: int, cfg: W4A16Config, block_k: int, sms: int) -> int:
    """Slices of K so that about two programs run per SM, each still walking at least four
    BLOCK_K steps (shorter walks cannot hide the load latency)."""
    if cfg.split_k:
        return cfg.split_k
    programs = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    wanted = cdiv(2 * sms, programs)
    return max(1, min(wanted, k // (4 * block_k)))


@triton.jit
def _w4a16_kernel(
    x_ptr, qw_ptr, scale_ptr, zero_ptr, perm_ptr, out_ptr, M, N, K,
    stride_xm, stride_qk, stride_sg, stride_os, stride_om,
    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_PERM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr, SCALE_AFTER_DOT: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_N: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Programs in groups of GROUP_M row tiles walk the column tiles together (L2 reuse).
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = pid_n * (BLOCK_N // PACK) + tl.arange(0, BLOCK_N // PACK)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_mask = offs_w < N // PACK
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        k = k0 + offs_k  # K is a multiple of BLOCK_K: no mask
        x = tl.load(x_rows + _input_rows(perm_ptr, k, HAS_PERM)[None, :], mask=m_mask[:, None], other=0.0)
        # (EVEN_N: the column tiles cover N exactly, so the weight tiles need no masks.)
        q = _load(qw_ptr + k[:, None].to(tl.int64) * stride_qk + offs_w[None, :], w_mask[None, :], EVEN_N)
        g = k0 // GROUP
        scale = _load(scale_ptr + g * stride_sg + offs_n, n_mask, EVEN_N).to(tl.float32)
        zero = _load(zero_ptr + g * stride_sg + offs_n, n_mask, EVEN_N).to(tl.float32)
        # (2^23 + q) - (2^23 + zero) = q - zero exactly: a small integer, exact in bf16/fp16.
        w = _widen(q.to(tl.uint32, bitcast=True), BITS).to(tl.float32, bitcast=True) - (zero + 8388608.0)[None, :]
        if SWAP_AB:
            # out^T = W^T x^T: the widened tile is the first operand (wgmma takes it from
            # registers); x^T is a view of x's tile in shared memory. The scales multiply the
            # weights even for few rows: a separate dot, scaled after, could not stay in flight.
            acc = tl.dot(tl.trans((w * scale[None, :]).to(x.dtype)), tl.trans(x), acc)
        elif SCALE_AFTER_DOT:
            # One group per K step: its scales multiply the step's [BLOCK_M, BLOCK_N] sums
            # instead of every weight (a 16-row tile has 8x fewer sums than a step has weights).
            acc += tl.dot(x, w.to(x.dtype)) * scale[None, :]
        else:
            acc = tl.dot(x, (w * scale[None, :]).to(x.dtype), acc)
    if SWAP_AB:
        out = out_ptr + pid_k * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[None, :] & n_mask[:, None])
    else:
        out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, perm: torch.Tensor | None = None, *, bits: int = 4, reduce: bool = True,
                 config: W4A16Config | None = None) -> torch.Tensor:
    """x [M, K] bf16/fp16 -> out [M, N] in x's dtype; see the module docstring for the layout. With
    reduce=False, a launch that splits K returns its slices unsummed, [S, M, N] float32."""
    validation_ops.check_w4a16(OP, x, qweight, scales, zeros, group_size, bits, perm, ACTIVATION_DTYPES)
    check_runnable(OP, x)
    m, k = x.shape
    n = qweight.shape[1] * (32 // bits)
    cfg = config or choose_config(m, n, k, bits, group_size, x.device)
    block_k = block_k_for(cfg, group_size)
    if group_size % block_k or block_k < 16:
        validation.fail(OP, f"group_size {group_size} needs a K step of at least 16 that divides it")
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    if cfg.method != "mma":
        if cfg.method == "dequant":
            return paths.w4a16_dequantize_matmul(x, qweight, scales, zeros, group_size, perm, bits, block_k)
        if cfg.block_n % (32 // bits):
            validation.fail(OP, f"a gemv config's block_n ({cfg.block_n}) must be a multiple of {32 // bits}")
        if cfg.block_m > 1:
            return gemv_rows.w4a16_gemv_rows(x, qweight, scales, zeros, group_size, perm, bits, cfg, block_k,
                                             num_sms(x.device), reduce)
        split = paths.gemv_split_k(m, n, k, cfg, block_k, num_sms(x.device), 32 // bits)
        return paths.w4a16_gemv(x, qweight, scales, zeros, group_size, perm, bits, cfg, block_k, split, reduce)
    split = choose_split_k(m, n, k, cfg, block_k, num_sms(x.device))
    # One slice: the kernel writes the output. Several: float32 partial sums, summed after
    # (split_k.finish).
    out = slices_or_output(split, m, n, x.dtype, x.device)
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n), split)
    _w4a16_kernel[grid](
        x, qweight, scales, zeros, qweight if perm is None else perm, out, m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), out.stride(1),
        GROUP=group_size, BITS=bits, HAS_PERM=perm is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, SPLIT_K=split,
        GROUP_M=cfg.group_m, SCALE_AFTER_DOT=cfg.block_m <= 16 and not cfg.swap_ab, SWAP_AB=cfg.swap_ab,
        EVEN_N=n % cfg.block_n == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return finish(out, x.dtype, reduce)
