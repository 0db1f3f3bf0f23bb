"""Every kernel op declared once: its name, the module whose Triton launcher runs it, and its
PyTorch reference; and the one place that picks between them by device.

Calling an op runs the Triton kernel on CUDA tensors and the reference elsewhere (the CPU
engine). `op.triton(...)` runs the kernel whatever the device (CPU tensors need
TRITON_INTERPRET=1: the interpreter tests) and `op.reference(...)` the reference. The launcher
is imported on first use, not here: Triton fixes interpreter mode when it is imported, and
importing `kernels` must not decide that for the rest of the process. Each launcher checks its
arguments first (ValueError naming the op and the argument, `kernels/validation*.py`); optional
keyword-only arguments (`config=`, `num_warps=`, ...) reach the launcher for the benchmarks'
sweeps.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from importlib import import_module
from typing import Any, Callable

import torch

from . import reference


@dataclass(frozen=True)
class KernelOp:
    name: str
    module: str  # kernels/<module>.py holds the launcher, a function named `name`
    reference: Callable[..., Any]  # the same signature, in plain PyTorch

    @cached_property
    def triton(self) -> Callable[..., Any]:
        """The launcher (imported once, on first use)."""
        return getattr(import_module(f"{__package__}.{self.module}"), self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The first argument is a tensor on the device the op runs on."""
        first = args[0]
        if isinstance(first, torch.Tensor) and first.is_cuda:
            return self.triton(*args, **kwargs)
        return self.reference(*args, **kwargs)


OPS: dict[str, KernelOp] = {op.name: op for op in (
    KernelOp("store_kv_cache", "kv_store", reference.store_kv_cache_ref),
    KernelOp("paged_decode_attention", "decode_attention", reference.paged_decode_attention_ref),
    KernelOp("paged_prefill_attention", "prefill_attention", reference.paged_prefill_attention_ref),
    KernelOp("rms_norm", "norm", reference.rms_norm_ref),
    KernelOp("rms_norm_quant_fp8", "norm", reference.rms_norm_quant_fp8_ref),
    KernelOp("apply_rotary_emb", "rotary", reference.apply_rotary_emb_ref),
    KernelOp("silu_and_mul", "activation", reference.silu_and_mul_ref),
    KernelOp("silu_and_mul_quant_fp8", "activation", reference.silu_and_mul_quant_fp8_ref),
    KernelOp("quantize_fp8_per_token", "quant", reference.quantize_fp8_per_token_ref),
    KernelOp("fp8_matmul_few_rows", "fp8_matmul", reference.fp8_matmul_few_rows_ref),
    KernelOp("greedy_sample", "sampling", reference.greedy_sample_ref),
    KernelOp("apply_penalties", "sampling", reference.apply_penalties_ref),
    KernelOp("add_lora", "lora", reference.add_lora_ref),
    KernelOp("w4a16_matmul", "w4a16", reference.w4a16_matmul_ref),
    KernelOp("w4a16_fragment_linear", "w4a16_fragment_paths", reference.w4a16_fragment_linear_ref),
    KernelOp("fused_moe", "moe", reference.fused_moe_ref),
    KernelOp("topk_softmax", "moe_router", reference.topk_softmax_ref),
)}
