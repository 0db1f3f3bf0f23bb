"""FP8 matmul for a few rows (decode batches of at most 16 sequences):
out = (x_q @ w_q^T) * x_scale * w_scale, with per-row activation scales and per-output-channel
weight scales, as torch._scaled_mm computes it with row-wise scaling.

torch._scaled_mm's kernels are tiled for many rows; with one to 16 rows they read FP8 weights
more slowly than F.linear reads bf16 ones, so FP8 made batch-1 decode slower than bf16. Here
every program owns BLOCK_N output columns (and one of SPLIT_K slices of K) for all rows at once
(the rows are padded to one 16-row MMA tile), so each weight byte is read once, in long
contiguous runs, by enough programs to cover the GPU. The K slices' partial sums go to a float32
buffer that is reduced in a fixed order (no atomics: the result does not depend on timing).

The best tile differs by shape (up to 1.5x on a small layer), so each GPU model may have a table
of measured configs per weight shape, kernels/configs/fp8_matmul.json, written by
`benchmarks/kernels/fp8_matmul.py --write-configs`; other shapes and GPUs take the default config.
A table, not an autotuner at start-up: the choice, and so the summation order, is the same in
every run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import FP8_MATMUL_MAX_ROWS as MAX_ROWS
from . import validation_ops
from ._launch import cdiv, check_runnable, num_sms
from ._tuned import device_name, load_table
from .split_k import finish, slices_or_output

OP = "fp8_matmul_few_rows"


@dataclass(frozen=True)
class Fp8MatmulConfig:
    block_n: int = 64
    block_k: int = 128
    split_k: int = 0  # 0: enough slices for about two programs per SM
    num_warps: int = 4
    num_stages: int = 4
    # out^T = w x^T: the weight tile is the MMA's first operand, so on sm_90 both FP8 operands
    # go from shared memory into an FP8 wgmma (block_n a multiple of 64 per warpgroup); the
    # unswapped 16-row tile is mma.sync, which loads both tiles into registers and widens them
    # to 16 bits first.
    swap_ab: bool = False


TUNED_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "fp8_matmul.json")


def shape_key(n: int, k: int) -> str:
    return f"{n}x{k}"


def load_tuned_configs(path: str = TUNED_CONFIGS) -> dict[str, dict[str, Fp8MatmulConfig]]:
    """{GPU name: {"NxK": config}} from the table; empty when there is none."""
    return load_table(path, Fp8MatmulConfig, _check_entry)


def _check_entry(shape: str, cfg: Fp8MatmulConfig) -> None:
    dims = shape.split("x")
    if len(dims) != 2 or not all(d.isdigit() and int(d) > 0 for d in dims):
        raise ValueError("the shape must be N x K, like 4096x14336")
    for name in ("block_n", "block_k"):
        side = getattr(cfg, name)
        if side < 16 or side & (side - 1):
            raise ValueError(f"{name} must be a power of two of at least 16, got {side}")
    if cfg.num_warps not in (1, 2, 4, 8) or cfg.num_stages < 1 or cfg.split_k < 0:
        raise ValueError(f"num_warps must be 1, 2, 4 or 8, num_stages at least 1 and split_k at least 0, got {cfg}")


def tuned_config(n: int, k: int, device_name: str, path: str | None = None) -> Fp8MatmulConfig:
    """The config measured fastest for an [N, K] weight on this GPU model, else the default."""
    table = load_tuned_configs(path or TUNED_CONFIGS)
    return table.get(device_name, {}).get(shape_key(n, k), Fp8MatmulConfig())


def choose_split_k(n: int, k: int, cfg: Fp8MatmulConfig, sms: int) -> int:
    """Slices of K so that about two programs run per SM, each still walking at least four
    BLOCK_K steps (shorter walks cannot hide the load latency)."""
    if cfg.split_k:
        return cfg.split_k
    programs = cdiv(n, cfg.block_n)
    wanted = cdiv(2 * sms, programs)
    return max(1, min(wanted, k // (4 * cfg.block_k)))


@triton.jit
def _fp8_matmul_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_os, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        k = k0 + offs_k
        k_mask = k < K
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if SWAP_AB:
            # The FP8 wgmma's own accumulator keeps fewer bits than float32; adding each K
            # step's products into float32 keeps the sum as exact as the unswapped path's.
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    x_scale = tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)
    w_scale = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)
    if SWAP_AB:
        acc = acc * w_scale[:, None] * x_scale[None, :]
        out = out_ptr + pid_k * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[None, :] & n_mask[:, None])
    else:
        acc = acc * x_scale[:, None] * w_scale[None, :]
        out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_matmul_few_rows(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                        weight_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, *,
                        reduce: bool = True, config: Fp8MatmulConfig | None = None) -> torch.Tensor:
    """x_q [M, K] float8_e4m3fn with M <= 16, x_scale [M, 1] float32, weight [N, K]
    float8_e4m3fn, weight_scale [1, N] float32 -> out [M, N] in out_dtype; with reduce=False,
    K slices (when the launch splits K) come back unsummed, [S, M, N] float32."""
    validation_ops.check_fp8_matmul(OP, x_q, x_scale, weight, weight_scale, out_dtype, MAX_ROWS)
    check_runnable(OP, x_q)
    m, k = x_q.shape
    n = weight.shape[0]
    cfg = config or tuned_config(n, k, device_name(x_q.device))
    split = choose_split_k(n, k, cfg, num_sms(x_q.device))
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    out = slices_or_output(split, m, n, out_dtype, x_q.device)
    _fp8_matmul_kernel[(cdiv(n, cfg.block_n), split)](
        x_q, x_scale, weight, weight_scale, out, m, n, k,
        x_q.stride(0), weight.stride(0), out.stride(0), out.stride(1),
        BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split, SWAP_AB=cfg.swap_ab,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return finish(out, out_dtype, reduce)
