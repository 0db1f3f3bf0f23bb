"""Tritium's GPU kernels (OpenAI Triton) behind the API of docs/architecture.md.

Each op is declared once in `kernels/ops.py` (its Triton launcher's module and its PyTorch
reference) and exported here: `kernels.rms_norm(...)` runs the Triton kernel on CUDA tensors and
the reference (`kernels.reference.rms_norm_ref`) elsewhere; `kernels.rms_norm.triton(...)` runs
the kernel on any device (CPU tensors under TRITON_INTERPRET=1, the tests).

Triton is imported on the first kernel call, not here, because Triton fixes interpreter mode at
import: importing `kernels` (as backend/ does) must not decide it for the rest of the process.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# fp8_matmul_few_rows serves at most this many rows (one MMA tile); more go to torch._scaled_mm.
FP8_MATMUL_MAX_ROWS = 16

from .ops import OPS, KernelOp  # noqa: E402 (reference, imported by ops, reads the constant above)

globals().update(OPS)

__all__ = [*OPS, "KernelOp", "OPS", "FP8_MATMUL_MAX_ROWS", "moe_align_block_size"]


def __getattr__(name: str) -> Any:
    # The fused MoE's routing step (a Triton program or torch ops by size; no reference of its
    # own): importing it imports Triton, so only on first use.
    if name == "moe_align_block_size":
        return import_module(".moe_align", __name__).moe_align_block_size
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
