"""Dense matmul for the linear layers, `y = x @ W^T` with W stored [N, K] as checkpoints hold it,
and the same with the Llama MLP's activation fused into the epilogue.

Why our own GEMM next to cuBLAS: at a decode batch (M = 256 rows) cuBLAS's tiles leave part of
the GPU idle on the last wave, and the MLP's gate/up product is written out in full (2 x I
columns) only for a second kernel to read it back and write silu(gate) * up. `linear_silu_and_mul`
computes the gate and up tiles of the same output columns in one program (two accumulators) and
writes only the activated [M, I] result.

Operands travel by TMA (tensor descriptors): the tile loads are bulk copies into shared memory,
pipelined `num_stages` deep, feeding wgmma on Hopper. Programs are ordered in groups of
`group_m` row tiles per column tile so the programs that share a weight tile run together and
the second reads it from L2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import validation
from ._launch import cdiv, check_runnable

OP = "linear"
OP_SILU = "linear_silu_and_mul"


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4
    warp_specialize: bool = False  # producer/consumer warps for the K loop (Triton's)


def default_config(m: int, n: int, k: int, dtype: torch.dtype, fused: bool) -> MatmulConfig:
    if dtype == torch.float32:  # tests: small tiles that fit shared memory in 32-bit
        return MatmulConfig(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=2)
    return MatmulConfig()


@triton.jit
def _matmul_kernel(a_desc, b_desc, c_desc, M, N, K,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, SILU_AND_MUL: tl.constexpr, NUM_STAGES: tl.constexpr,
                   WARP_SPECIALIZE: tl.constexpr):
    # N is the number of output columns; with SILU_AND_MUL the weight has 2 * N rows: the gate
    # rows [0, N) then the up rows [N, 2N).
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SILU_AND_MUL:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kk in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES,
                           warp_specialize=WARP_SPECIALIZE):
        off_k = kk * BLOCK_K
        a = a_desc.load([off_m, off_k])
        b = b_desc.load([off_n, off_k])
        acc = tl.dot(a, b.T, acc)
        if SILU_AND_MUL:
            u = b_desc.load([N + off_n, off_k])
            acc_up = tl.dot(a, u.T, acc_up)

    out_ty = c_desc.dtype
    if SILU_AND_MUL:
        # The unfused path's roundings: gate and up rounded to the output dtype (the GEMM's
        # output), silu(gate) rounded, then the product (kernels/activation.py).
        gate = acc.to(out_ty).to(tl.float32)
        up = acc_up.to(out_ty).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
        c_desc.store([off_m, off_n], (silu * up).to(out_ty))
    else:
        c_desc.store([off_m, off_n], acc.to(out_ty))


def _launch(op: str, x: torch.Tensor, weight: torch.Tensor, out_cols: int, fused: bool,
            out: torch.Tensor | None, config: MatmulConfig | None) -> torch.Tensor:
    validation.check_matmul(op, x, weight, out, out_cols, validation.HALF_AND_FLOAT)
    check_runnable(op, x)
    m, k = x.shape
    if out is None:
        out = torch.empty(m, out_cols, dtype=x.dtype, device=x.device)
    if m == 0 or out_cols == 0:
        return out
    cfg = config or default_config(m, out_cols, k, x.dtype, fused)
    a_desc = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
    b_desc = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    c_desc = TensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n])
    grid = (cdiv(m, cfg.block_m) * cdiv(out_cols, cfg.block_n),)
    _matmul_kernel[grid](a_desc, b_desc, c_desc, m, out_cols, k,
                         BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                         GROUP_M=cfg.group_m, SILU_AND_MUL=fused, NUM_STAGES=cfg.num_stages,
                         WARP_SPECIALIZE=cfg.warp_specialize, num_warps=cfg.num_warps)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, *,
           config: MatmulConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N], accumulated in float32."""
    n = weight.shape[0] if weight.dim() == 2 else 0
    return _launch(OP, x, weight, n, False, out, config)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, *,
                        config: MatmulConfig | None = None) -> torch.Tensor:
    """weight [2I, K] = cat(gate, up) -> silu(x @ gate^T) * (x @ up^T), [M, I]."""
    rows = weight.shape[0] if weight.dim() == 2 else 0
    if rows % 2:
        validation.fail(OP_SILU, f"weight must have an even number of rows (gate and up), got {rows}")
    return _launch(OP_SILU, x, weight, rows // 2, True, out, config)
