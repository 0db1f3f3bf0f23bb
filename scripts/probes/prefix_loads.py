#!/usr/bin/env python3
"""Probe: why prefill attention's loop over the cached prefix runs slower than its loop over the
chunk's own keys. One chunk of queries attends (no mask) to a prefix of keys, read six ways:

  paged      through the block table, token by token (what the kernel does)
  contiguous plain pointer loads from a contiguous [P, Hkv, D] copy (no block table)
  prefetch   through the block table, the next tile's row addresses loaded one tile ahead
  tma        TMA boxes from the contiguous copy (what the chunk's keys get)
  runs       through the block table, one block id per run of block_size tokens, a 3-D load
  tma_pages  TMA boxes of one cache block each (block_size rows), joined into a tile

    python3 scripts/probes/prefix_loads.py --json $OUT/prefix_loads.json
    TRITON_INTERPRET=1 python3 scripts/probes/prefix_loads.py --device cpu --dtype float32 \
        --queries 32 --prefix 64 --block-m 16 --block-n 64 --stages 2   # correctness rehearsal
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tritium.kernels._attention_tile import attend_tile, kv_row_offsets

MODES = ["paged", "contiguous", "prefetch", "tma", "runs", "tma_pages"]


@triton.jit
def _paged_tile(k_cache, v_cache, block_table, n0, offs_n, offs_d, head_off, stride_cb, stride_ct,
                BS: tl.constexpr):
    rows = kv_row_offsets(block_table, n0 + offs_n, offs_n >= 0, head_off, stride_cb, stride_ct, BS)
    return (tl.load(k_cache + rows[:, None] + offs_d[None, :]),
            tl.load(v_cache + rows[:, None] + offs_d[None, :]))


@triton.jit
def _probe_kernel(q_ptr, k_cache, v_cache, block_table, k_flat, v_flat, k_desc, v_desc, kp_desc,
                  vp_desc, out_ptr, P, scale_log2e, stride_qt, stride_qh, stride_cb, stride_ct,
                  stride_ft, GROUP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
                  STAGES: tl.constexpr):
    head = tl.program_id(0)
    kv_head = head // GROUP
    m0 = tl.program_id(1) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, D], 0.0, tl.float32)
    head_off = kv_head * D
    rows_next = kv_row_offsets(block_table, offs_n, offs_n >= 0, head_off, stride_cb, stride_ct, BS)
    for n0 in tl.range(0, P, BLOCK_N, num_stages=STAGES):
        if MODE == 0:
            k, v = _paged_tile(k_cache, v_cache, block_table, n0, offs_n, offs_d, head_off,
                               stride_cb, stride_ct, BS)
        elif MODE == 1:
            rows = (n0 + offs_n) * stride_ft + head_off
            k = tl.load(k_flat + rows[:, None] + offs_d[None, :])
            v = tl.load(v_flat + rows[:, None] + offs_d[None, :])
        elif MODE == 2:
            rows = rows_next
            nxt = n0 + BLOCK_N + offs_n
            rows_next = kv_row_offsets(block_table, nxt, nxt < P, head_off, stride_cb, stride_ct, BS)
            k = tl.load(k_cache + rows[:, None] + offs_d[None, :])
            v = tl.load(v_cache + rows[:, None] + offs_d[None, :])
        elif MODE == 3:
            k = k_desc.load([n0, head_off])
            v = v_desc.load([n0, head_off])
        elif MODE == 4:
            RUNS: tl.constexpr = BLOCK_N // BS
            first = n0 + tl.arange(0, RUNS) * BS
            blk = tl.load(block_table + first // BS).to(tl.int64)
            base = blk * stride_cb + head_off
            offs_t = tl.arange(0, BS)
            ptrs = base[:, None, None] + offs_t[None, :, None] * stride_ct + offs_d[None, None, :]
            k = tl.reshape(tl.load(k_cache + ptrs), (BLOCK_N, D))
            v = tl.reshape(tl.load(v_cache + ptrs), (BLOCK_N, D))
        else:
            # Four boxes of BS rows (BLOCK_N == 4 * BS), joined pairwise.
            b0 = tl.load(block_table + n0 // BS) * BS
            b1 = tl.load(block_table + n0 // BS + 1) * BS
            b2 = tl.load(block_table + n0 // BS + 2) * BS
            b3 = tl.load(block_table + n0 // BS + 3) * BS
            k01 = tl.reshape(tl.permute(tl.join(kp_desc.load([b0, head_off]), kp_desc.load([b1, head_off])), (2, 0, 1)), (2 * BS, D))
            k23 = tl.reshape(tl.permute(tl.join(kp_desc.load([b2, head_off]), kp_desc.load([b3, head_off])), (2, 0, 1)), (2 * BS, D))
            v01 = tl.reshape(tl.permute(tl.join(vp_desc.load([b0, head_off]), vp_desc.load([b1, head_off])), (2, 0, 1)), (2 * BS, D))
            v23 = tl.reshape(tl.permute(tl.join(vp_desc.load([b2, head_off]), vp_desc.load([b3, head_off])), (2, 0, 1)), (2 * BS, D))
            k = tl.reshape(tl.permute(tl.join(k01, k23), (2, 0, 1)), (BLOCK_N, D))
            v = tl.reshape(tl.permute(tl.join(v01, v23), (2, 0, 1)), (BLOCK_N, D))
        m_i, l_i, acc = attend_tile(q, k, v, 0, m_i, l_i, acc, scale_log2e, False, "tf32")
    o = acc / l_i[:, None]
    tl.store(out_ptr + offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queries", type=int, default=8192)
    ap.add_argument("--prefix", type=int, default=24576)
    ap.add_argument("--heads", default="28,4")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--block-m", type=int, default=128)
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = a.device, getattr(torch, a.dtype)
    hq, hkv = (int(x) for x in a.heads.split(","))
    d, bs, p, t = a.head_dim, a.block_size, a.prefix, a.queries
    assert p % a.block_n == 0 and t % a.block_m == 0, "whole tiles only"
    assert a.block_n == 4 * bs or "tma_pages" not in a.modes, "tma_pages joins four cache blocks a tile"
    q = torch.randn(t, hq, d, device=dev, dtype=dt)
    k = torch.randn(p, hkv, d, device=dev, dtype=dt)
    v = torch.randn(p, hkv, d, device=dev, dtype=dt)
    table = torch.randperm(p // bs, device=dev).int()
    k_cache = torch.zeros(p // bs, bs, hkv, d, device=dev, dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    slots = (table.long()[:, None] * bs + torch.arange(bs, device=dev)).flatten()
    k_cache.view(-1, hkv, d)[slots] = k
    v_cache.view(-1, hkv, d)[slots] = v
    scale = d ** -0.5
    ref = torch.softmax((q.float().transpose(0, 1) @ k.float().repeat_interleave(hq // hkv, 1)
                         .permute(1, 2, 0)) * scale, -1) @ v.float().repeat_interleave(hq // hkv, 1).transpose(0, 1)
    ref = ref.transpose(0, 1)
    descs = [TensorDescriptor(x.view(-1, hkv * d), [x.numel() // (hkv * d), hkv * d], [hkv * d, 1], [box, d])
             for x, box in ((k, a.block_n), (v, a.block_n), (k_cache, bs), (v_cache, bs))]
    flops = 4.0 * t * p * d * hq
    gpu = torch.cuda.get_device_name() if dev != "cpu" else "cpu"
    print(f"{gpu}; {t} queries x {p} prefix keys, {hq}/{hkv} heads x {d}, {a.dtype}, "
          f"tiles {a.block_m}x{a.block_n}, {a.warps} warps, cache blocks of {bs}")
    rows = []
    for mode in a.modes.split(","):
        for stages in (int(s) for s in a.stages.split(",")):
            out = torch.empty_like(q)

            def call():
                _probe_kernel[(hq, t // a.block_m)](
                    q, k_cache, v_cache, table, k, v, *descs, out, p, scale * 1.4426950408889634,
                    q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k.stride(0),
                    GROUP=hq // hkv, D=d, BS=bs, BLOCK_M=a.block_m, BLOCK_N=a.block_n,
                    MODE=MODES.index(mode), STAGES=stages, num_warps=a.warps, num_stages=stages)
            try:
                call()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                if dev == "cpu":
                    start = time.perf_counter()
                    call()
                    ms = (time.perf_counter() - start) * 1e3
                else:
                    ms = triton.testing.do_bench(call, warmup=5, rep=40, return_mode="median")
            except Exception as exc:  # a mode the compiler refuses
                print(f"{mode:>11} st{stages}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            rows.append({"mode": mode, "stages": stages, "ms": ms, "tflops": flops / ms / 1e9, "rel_err": err})
            print(f"{mode:>11} st{stages}: {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s  rel err {err:.1e}")
    # The engine's kernel on the same prefix plus a causal chunk of the same queries (their keys
    # stored after the prefix), with the chunk's K/V passed (TMA) and without (all through the cache).
    from tritium import kernels
    kc, vc = torch.randn(t, hkv, d, device=dev, dtype=dt), torch.randn(t, hkv, d, device=dev, dtype=dt)
    blocks = (p + t) // bs
    full_table = torch.randperm(blocks, device=dev).int()
    kcache = torch.zeros(blocks, bs, hkv, d, device=dev, dtype=dt)
    vcache = torch.zeros_like(kcache)
    fslots = (full_table.long()[:, None] * bs + torch.arange(bs, device=dev)).flatten()
    kcache.view(-1, hkv, d)[fslots] = torch.cat([k, kc])
    vcache.view(-1, hkv, d)[fslots] = torch.cat([v, vc])
    cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
    lens = torch.tensor([p + t], dtype=torch.int32, device=dev)
    chunk_flops = flops + 4.0 * d * hq * t * (t + 1) / 2
    for label, kw in (("engine, chunk K/V passed", dict(key=kc, value=vc)), ("engine, all through the cache", {})):
        fn = lambda: kernels.paged_prefill_attention.triton(q, kcache, vcache, full_table[None], cu, lens, t,  # noqa: E731
                                                     scale, **kw)
        fn()
        ms = triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median") if dev != "cpu" else 0.0
        rows.append({"mode": label, "ms": ms, "tflops": chunk_flops / max(ms, 1e-9) / 1e9})
        print(f"{label}: {ms:8.3f} ms {chunk_flops / max(ms, 1e-9) / 1e9:6.0f} TFLOP/s (prefix + causal chunk)")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": gpu, "args": vars(a), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
