"""Shared helpers for the kernel tests: device choice, error bounds, paged-cache builders and an
attention oracle written independently of kernels.reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"

# Triton's interpreter cannot compute in bfloat16: it stores bf16 as uint16, tl.dot multiplies
# the raw bit patterns (triton-lang/triton#11584) and float32 -> bf16 casts truncate instead of
# rounding. Loads and stores work, but the kernels' results would not be the GPU's. So bf16 is
# tested on the GPU only; float16 and float32 run everywhere.
BF16_ON_GPU_ONLY = "bf16 needs a GPU: Triton's interpreter has no bf16 arithmetic (triton#11584)"
DTYPES = [torch.float32, torch.float16,
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not ON_GPU, reason=BF16_ON_GPU_ONLY))]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in out (an unwritten poisoned element) is inf."""
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def assert_accurate(out: torch.Tensor, ref64: torch.Tensor, torch_at_dtype: torch.Tensor) -> None:
    """float32: relative error under 1e-4. Half types: at most twice the error PyTorch makes
    doing the same computation in that dtype (both measured against the float64 result)."""
    err = rel_err(out, ref64)
    if out.dtype == torch.float32:
        assert err < 1e-4, f"float32 relative error {err:.3g} >= 1e-4"
    else:
        bound = 2 * rel_err(torch_at_dtype, ref64) + 1e-6
        assert err <= bound, f"{out.dtype} relative error {err:.3g} > 2 x PyTorch's ({bound:.3g})"


def poisoned(shape, dtype, device=DEVICE) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@dataclass
class PagedKV:
    """A paged cache holding one K/V history per sequence in shuffled physical blocks. Every
    slot not holding a real token is NaN, and block-table padding points at an all-NaN block,
    so a kernel that reads past a sequence's context gets NaN in its output."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    keys: list[torch.Tensor]     # per sequence [L, Hkv, D], the values stored (cache dtype), on CPU
    values: list[torch.Tensor]


def make_paged_kv(context_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                  dtype: torch.dtype, gen: torch.Generator, device: str = DEVICE) -> PagedKV:
    blocks = [cdiv(n, block_size) for n in context_lens]
    max_blocks = max(blocks + [0]) + 1
    num_blocks = sum(blocks) + 2
    free = torch.randperm(num_blocks, generator=gen).tolist()
    nan_block = free.pop()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.full((len(context_lens), max_blocks), nan_block, dtype=torch.int32)
    keys, values = [], []
    for b, n in enumerate(context_lens):
        ids = torch.tensor([free.pop() for _ in range(blocks[b])], dtype=torch.long)
        block_tables[b, :len(ids)] = ids.int()
        pos = torch.arange(n)
        slots = ids[pos // block_size] * block_size + pos % block_size if n else pos
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v
        keys.append(k)
        values.append(v)
    return PagedKV(k_cache.to(device), v_cache.to(device), block_tables.to(device), keys, values)


def attention_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                     scale: float, dtype: torch.dtype) -> torch.Tensor:
    """q [n, Hq, D] attends causally (key position <= q_positions[i]) to contiguous k/v
    [L, Hkv, D]; every operation in `dtype`. float64 gives ground truth; a half dtype gives
    'the same computation done in PyTorch at that dtype'."""
    group = q.shape[1] // k.shape[1]
    if k.shape[0] == 0:
        return torch.zeros(q.shape, dtype=dtype, device=q.device)
    k = k.to(dtype).repeat_interleave(group, dim=1)
    v = v.to(dtype).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(dtype), k) * scale
    # On k's device: long-context tests on a GPU compute their ground truth there.
    hidden = torch.arange(k.shape[0], device=k.device)[None, :] > q_positions.to(k.device)[:, None]
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


H100_MAX_SHARED = 232448  # bytes of shared memory one block may use on sm_90


def compile_for_hopper(script: str, *flags: str) -> list[dict]:
    """Run one of the sm_90 compile scripts beside this file (compiled mode, so without
    TRITON_INTERPRET) and return its JSON lines: one per kernel launch it built."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / script), *flags],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def assert_fits_without_spills(launch: dict, stack_limit: int = 0) -> None:
    assert launch["shared"] <= H100_MAX_SHARED, f"over sm_90's shared memory: {launch}"
    assert launch.get("local_bytes", 0) == 0 and launch.get("stack_bytes", 0) <= stack_limit, \
        f"spills to local memory: {launch}"
