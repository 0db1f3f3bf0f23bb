"""Does programmatic dependent launch (PDL) shorten a CUDA graph of small dependent kernels on
this GPU and Triton version, and is it still correct? Times, captured in CUDA graphs:
a chain of Triton kernels each reading the previous one's output (decode-sized tensors), and
a chain of (cuBLAS GEMM at M=256 -> Triton kernel) pairs, with and without `launch_pdl`.

    python3 scripts/probe_pdl.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl


@triton.jit
def _add_one_kernel(x_ptr, y_ptr, n, PDL: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible after this
    x = tl.load(x_ptr + offs, mask=offs < n)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(y_ptr + offs, x + 1, mask=offs < n)


def add_one(x: torch.Tensor, y: torch.Tensor, pdl: bool) -> None:
    n = x.numel()
    block = 2048
    _add_one_kernel[(triton.cdiv(n, block),)](x, y, n, PDL=pdl, BLOCK=block, launch_pdl=pdl)


def graph_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    result: dict = {"triton": triton.__version__, "torch": torch.__version__}
    bufs = [torch.zeros(256 * 4096, device="cuda", dtype=torch.float32) for _ in range(2)]
    chain = 300

    def triton_chain(pdl: bool):
        def fn():
            bufs[0].zero_()
            for i in range(chain):
                add_one(bufs[i % 2], bufs[(i + 1) % 2], pdl)
        return fn

    for pdl in (False, True):
        ms = graph_ms(triton_chain(pdl))
        ok = bool((bufs[chain % 2] == chain).all())
        result[f"triton_chain_pdl_{pdl}"] = {"ms": ms, "us_per_kernel": ms * 1000 / (chain + 1), "correct": ok}
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    x0 = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    h = torch.empty_like(x0)
    pairs = 32

    def gemm_chain(pdl: bool):
        out = {}

        def fn():
            x = x0
            for _ in range(pairs):
                y = torch.nn.functional.linear(x, w)
                add_one(y, h, pdl)
                x = h
            out["x"] = x
        return fn, out

    ref = None
    for pdl in (False, True):
        fn, out = gemm_chain(pdl)
        ms = graph_ms(fn)
        if ref is None:
            ref = out["x"].clone()
        result[f"gemm_chain_pdl_{pdl}"] = {"ms": ms, "us_per_pair": ms * 1000 / pairs,
                                           "equal_to_no_pdl": bool(torch.equal(out["x"], ref))}
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
