"""Probe: 4-bit weights repacked into wgmma's A-fragment order reach the MMA from registers with
no trip through shared memory, in triton.language (issue 52's W4A16 design step; no GPU needed).

The shipped layout packs eight columns of one K row in a word (`kernels/w4a16.py`), so the
widened tile must be redistributed before the MMA: even with the operands swapped
(`W4A16Config.swap_ab`), the sm_90 build takes it through a shared-memory scratch every K step.
Here the words of each [64 N x 64 K] slab are reordered at load time so that thread t of a
warpgroup loads, in four contiguous words, exactly the 32 values of its wgmma A fragment
(t = warp * 32 + g * 4 + tid; value i = kstep * 8 + khalf * 4 + rowhalf * 2 + pair holds
n = warp * 16 + rowhalf * 8 + g, k = kstep * 16 + khalf * 8 + tid * 2 + pair). The kernel widens
the words, reshapes and permutes the values into the [64, 64] tile (Triton's layouts follow
without moving data) and hands it to tl.dot with x^T as the second operand.

    .venv/bin/python -m scripts.probes.w4a16_fragment_layout --check   # the mapping is exact (interpreter)
    .venv/bin/python -m scripts.probes.w4a16_fragment_layout --sm90    # shared-memory traffic in the sm_90 loop

`--check` runs under TRITON_INTERPRET=1 (set here) against x @ W^T; `--sm90` compiles for sm_90
without a GPU and counts, inside the K loop of the PTX, shared-memory stores and loads and wgmma
instructions (0 stores: the tile never goes through shared memory; the one load is the words'
cp.async tile), and the SASS loop's instructions a weight. Zeros and scales apply per group as
in the kernel (each thread holds two columns). Not yet: act-order, 8-bit fields, tiles of
several slabs, a GEMV on the same layout (one row), timing.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

SLAB = 64  # a warpgroup's N rows, and the K step


def repack(q):
    """q [K, N] 4-bit values (an integer tensor) -> words [K/64, N/64, 128, 4] int32 in fragment order."""
    import torch
    k, n = q.shape
    assert k % SLAB == 0 and n % SLAB == 0, (k, n)
    t = torch.arange(128)
    warp, g, tid = t // 32, (t // 4) % 8, t % 4
    i = torch.arange(32)
    kstep, khalf, rowhalf, pair = i // 8, (i // 4) % 2, (i // 2) % 2, i % 2
    rows = warp[:, None] * 16 + rowhalf[None, :] * 8 + g[:, None]               # [128, 32]: n in the slab
    cols = kstep[None, :] * 16 + khalf[None, :] * 8 + tid[:, None] * 2 + pair[None, :]  # k in the step
    tiles = q.reshape(k // SLAB, SLAB, n // SLAB, SLAB).permute(0, 2, 1, 3)      # [ks, slab, k, n]
    vals = tiles[:, :, cols, rows].long()                                      # [ks, slab, 128, 32]
    vals = vals.reshape(*vals.shape[:3], 4, 8)                                 # word = kstep, field = i % 8
    words = sum(vals[..., j] << (4 * j) for j in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def kernel():
    import triton
    import triton.language as tl

    global _widen  # the jitted kernel finds its helpers among this module's globals
    from tritium.kernels.w4a16_layout import _widen

    @triton.jit
    def _fragment_kernel(q_ptr, scale_ptr, zero_ptr, x_ptr, out_ptr, M, N, K, GROUP: tl.constexpr,
                         BLOCK_M: tl.constexpr):
        # out^T[slab's 64 columns, M rows] = W^T x^T, one warpgroup, weights (q - zero) * scale.
        pid_n = tl.program_id(0)
        t = tl.arange(0, 128)
        wd = tl.arange(0, 4)
        offs_m = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, 64)
        acc = tl.zeros((64, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, 64):
            words = q_ptr + ((k0 // 64) * (N // 64) + pid_n) * 512 + t[:, None] * 4 + wd[None, :]
            q = tl.load(words)
            v = _widen(q.to(tl.uint32, bitcast=True), 4).to(tl.float32, bitcast=True)
            v = tl.reshape(v, (4, 8, 4, 4, 2, 2, 2))                       # warp, g, tid, kstep, khalf, rowhalf, pair
            v = tl.reshape(tl.permute(v, (0, 5, 1, 3, 4, 2, 6)), (64, 64))  # [n, k]: two columns a thread
            cols = pid_n * 64 + tl.arange(0, 64)
            g = k0 // GROUP
            zero = tl.load(zero_ptr + g * N + cols).to(tl.float32) + 8388608.0
            scale = tl.load(scale_ptr + g * N + cols).to(tl.float32)
            w = ((v - zero[:, None]) * scale[:, None]).to(x_ptr.dtype.element_ty)
            x = tl.load(x_ptr + offs_m[:, None] * K + (k0 + kk)[None, :], mask=offs_m[:, None] < M, other=0.0)
            acc = tl.dot(w, tl.trans(x), acc)
        out = out_ptr + offs_m[None, :] * N + pid_n * 64 + tl.arange(0, 64)[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=offs_m[None, :] < M)

    return _fragment_kernel


def check() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    g = torch.Generator().manual_seed(0)
    m, n, k, group = 5, 128, 256, 128
    q = torch.randint(0, 16, (k, n), generator=g)
    zeros = torch.randint(0, 16, (k // group, n), generator=g).to(torch.float16)
    scales = (torch.rand(k // group, n, generator=g) * 2e-2 + 1e-3).to(torch.float16)
    x = torch.randn(m, k, generator=g).to(torch.float16)
    out = torch.empty(m, n, dtype=torch.float32)
    kernel()[(n // SLAB,)](repack(q), scales, zeros, x, out, m, n, k, GROUP=group, BLOCK_M=16)
    gi = torch.arange(k) // group
    w = ((q.double() - zeros.double()[gi]) * scales.double()[gi]).to(torch.float16).double()
    want = x.double() @ w
    err = ((out.double() - want).abs().max() / want.abs().max()).item()
    print(f"fragment-order repack, {m} x {k} @ {k} x {n}: max relative error {err:.2e}")
    sys.exit(0 if err < 1e-3 else 1)


def sm90() -> None:
    import torch
    from triton.runtime.jit import JITFunction

    from tests.kernels import hopper_compile
    JITFunction.run = hopper_compile._record
    e = torch.empty
    n, k = 6144, 4096
    s = e(k // 128, n, dtype=torch.float16)
    kernel()[(n // SLAB,)](e(k * n // 8, dtype=torch.int32), s, s, e(64, k, dtype=torch.bfloat16),
                           e(64, n, dtype=torch.bfloat16), 64, n, k, GROUP=128, BLOCK_M=64, num_warps=4, num_stages=3)
    fn, args, kwargs = hopper_compile.launches[0]
    compiled = hopper_compile.compile_kernel(fn, args, kwargs)
    from scripts.probes import gemv_sass
    sass = gemv_sass.instructions(gemv_sass.cuobjdump(compiled.asm["cubin"], "-sass"))
    first, last = max(gemv_sass.loops(sass), key=lambda r: sum(r[0] <= a <= r[1] for a, _, _ in sass))
    loop = sum(first <= a <= last for a, _, _ in sass)
    print(f"sm_90 SASS K loop: {loop} instructions for 32 weights a thread ({loop / 32:.1f} a weight)")
    ptx = compiled.asm["ptx"].splitlines()
    head = next(i for i, line in enumerate(ptx) if "Inner Loop Header" in line)
    label = ptx[head].split(":")[0].strip()
    end = next(i for i in range(head + 1, len(ptx)) if re.search(rf"bra(\.uni)?\s+{re.escape(label)};", ptx[i]))
    body = ptx[head:end + 1]
    count = lambda s: sum(s in line for line in body)  # noqa: E731
    print(f"sm_90 K loop: {count('st.shared')} shared stores, {count('ld.shared')} shared loads, "
          f"{count('wgmma.mma_async')} wgmma")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="the repack's mapping against x @ W^T (interpreter)")
    ap.add_argument("--sm90", action="store_true", help="shared-memory traffic in the sm_90 build's K loop")
    a = ap.parse_args()
    if a.check:
        check()
    if a.sm90:
        sm90()


if __name__ == "__main__":
    main()
