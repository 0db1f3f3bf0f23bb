"""What the w4a16 matmul's paths share (kernels/w4a16.py describes the layout): the config
that picks a path and its tiles, and the Triton helpers that widen packed words, gather
act-order rows and load a tile with or without masks."""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

METHODS = ("gemv", "mma", "dequant")


@dataclass(frozen=True)
class W4A16Config:
    block_m: int = 16  # gemv: rows a program (kernels/w4a16_gemv_rows.py when more than one)
    block_n: int = 64  # gemv: columns a program takes (a multiple of 32 / bits)
    block_k: int = 128  # at most the group size (one group's scales per K step)
    split_k: int = 0  # 0: enough K slices for about two programs per SM
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    # "mma": the tensor-core kernel below; "gemv": one program row per activation row, on the
    # CUDA cores; "dequant": the weight dequantized to 16 bits, then one cuBLAS GEMM.
    method: str = "mma"
    # gemv with several K slices: add the partial sums in the kernel (the last slice to finish
    # does) instead of a second kernel after it (split_k.sum_slices).
    fused_reduce: bool = False
    # gemv: K steps whose weight tiles are loading while one step computes (1 or 2; it
    # prefetches by hand, so num_stages does nothing there).
    prefetch: int = 1
    # mma: compute out^T = W^T x^T, the widened weight tile as the MMA's first operand. On
    # sm_90 that operand comes from registers, so the wgmma need not be waited for before the
    # next step widens its tile (unswapped, the tile is wgmma's shared-memory operand, and each
    # step waits); block_m is then the MMA's N (the activation rows a program takes).
    swap_ab: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method {self.method!r}: expected one of {', '.join(METHODS)}")
        if self.prefetch not in (1, 2):
            raise ValueError(f"prefetch {self.prefetch}: expected 1 or 2")
        if self.swap_ab and self.method != "mma":
            raise ValueError(f"swap_ab is a choice of the mma method, not of {self.method!r}")
        if self.method == "gemv" and self.block_m > 1 and (self.fused_reduce or self.prefetch != 1):
            raise ValueError(f"a gemv of {self.block_m} rows a program has no fused_reduce or prefetch")


@triton.jit
def _field(q, J: tl.constexpr, BITS: tl.constexpr):
    """Value J of each word as the bits of the float32 2^23 + value (a constant shift)."""
    return ((q >> (J * BITS)) & ((1 << BITS) - 1)) | 0x4B000000  # q uint32: logical shifts


@triton.jit
def _widen(q, BITS: tl.constexpr):
    """[R, W] words -> [R, W * 32 / BITS]: column P * w + j holds value j of word w. Joins add a
    minor dimension inside each thread (no data moves between threads), and every shift is a
    constant."""
    if BITS == 4:
        w = tl.join(tl.join(tl.join(_field(q, 0, BITS), _field(q, 4, BITS)),
                            tl.join(_field(q, 2, BITS), _field(q, 6, BITS))),
                    tl.join(tl.join(_field(q, 1, BITS), _field(q, 5, BITS)),
                            tl.join(_field(q, 3, BITS), _field(q, 7, BITS))))
    else:
        w = tl.join(tl.join(_field(q, 0, BITS), _field(q, 2, BITS)),
                    tl.join(_field(q, 1, BITS), _field(q, 3, BITS)))
    return tl.reshape(w, (q.shape[0], q.shape[1] * (32 // BITS)))


@triton.jit
def _input_rows(perm_ptr, k, HAS_PERM: tl.constexpr):
    """The activation columns that weight rows k multiply (GPTQ act-order's gather)."""
    if HAS_PERM:
        kx = tl.load(perm_ptr + k)
    else:
        kx = k
    return kx


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    """ptrs' values, or 0 where mask is false (EVEN: every one is in bounds, no mask)."""
    if EVEN:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=mask, other=0)
    return v
