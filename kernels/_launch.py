"""Where a kernel may run, and small host-side helpers shared by the wrappers.

Triton binds interpreter mode when it is imported: `TRITON_INTERPRET=1` makes every `@triton.jit`
function, including `tl.max`/`tl.sum`/`tl.zeros` inside triton.language, an interpreted Python
function. So the mode is a property of the process, fixed at the first `import triton`; this module
is imported only when a kernel is first called (see kernels/__init__.py), so setting the variable
any time before the first kernel call works. CPU tensors need that mode; CUDA tensors normally run
compiled kernels.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from .validation import fail

# True when this process imported Triton with TRITON_INTERPRET=1 (kernels run in NumPy).
INTERPRETED = not isinstance(triton.language.zeros, triton.runtime.JITFunction)

H200_SMS = 132  # used on the interpreter so split decisions match the GPU we tune for


def check_runnable(op: str, t: torch.Tensor) -> None:
    """Raise unless a Triton kernel can run on t's device in this process; decided per call."""
    if t.device.type == "cuda" or (INTERPRETED and t.device.type == "cpu"):
        return
    if t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        fail(op, "TRITON_INTERPRET=1 was set after triton was imported, so kernels are compiled "
                 "for the GPU; set it before the first import of triton (tests/kernels/conftest.py does)")
    fail(op, f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), got "
             f"{t.device}; on the CPU use kernels.reference.{op}_ref")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return H200_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dot_block(n: int) -> int:
    """Smallest power of two >= n that tl.dot accepts as a matrix side (16)."""
    return max(16, next_pow2(n))
