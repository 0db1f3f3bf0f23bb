#!/usr/bin/env python3
"""Sliding-window attention (Llama-3-8B heads, bf16) on the GPU: paged decode with a window
against SDPA over the window's keys gathered contiguous beforehand (what the window reads) and
against the same paged call without a window; paged prefill of one 4,096-token prompt with a
window against SDPA with the same boolean mask and against SDPA flash over the whole causal
prompt. Decode timed as CUDA graph replays after an L2 flush (kernel_table.Bench). Prints a
table, writes JSON.

    python3 benchmarks/kernels/window_attention.py --json $OUT/window_attention.json
"""
from __future__ import annotations

import argparse
import datetime
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import kernel_table as bk
from tritium import kernels
from tritium.kernels import reference

DECODE = [(1, 32768, 4096), (64, 8192, 4096), (256, 2048, 1024)]  # (batch, context, window)
PREFILL = (4096, 1024)  # (prompt tokens, window)


def decode_row(b: bk.Bench, batch: int, ctx: int, window: int, copy_gbps: float) -> dict:
    q, kc, vc, bt, cl = bk.decode_inputs(batch, ctx)
    ref = reference.paged_decode_attention_ref(q.float(), kc.float(), vc.float(), bt, cl, bk.SCALE,
                                               sliding_window=window)
    check = lambda out: bk.rel_err(out, ref)  # noqa: E731
    windowed = b.checked("triton, window", lambda: kernels.paged_decode_attention.triton(
        q, kc, vc, bt, cl, bk.SCALE, sliding_window=window), check)
    full = b.checked("triton, no window", lambda: kernels.paged_decode_attention.triton(q, kc, vc, bt, cl, bk.SCALE),
                     lambda out: 0.0)
    # The window's keys gathered contiguous, not timed: SDPA reads exactly what the window sees.
    k = kc[bt.long()].view(batch, ctx, bk.HKV, bk.D)[:, ctx - window:].transpose(1, 2).contiguous()
    v = vc[bt.long()].view(batch, ctx, bk.HKV, bk.D)[:, ctx - window:].transpose(1, 2).contiguous()
    q4 = q[:, :, None, :]
    sdpa = b.checked("torch sdpa over the window (contiguous)", lambda: F.scaled_dot_product_attention(
        q4, k, v, scale=bk.SCALE, enable_gqa=True), lambda o: bk.rel_err(o[:, :, 0], ref))
    kv_bytes = 2 * batch * window * bk.HKV * bk.D * 2
    row = {"batch": batch, "context": ctx, "window": window, "window_kv_bytes": kv_bytes,
           "floor_us": kv_bytes / copy_gbps / 1e3, "rows": [windowed, full, sdpa]}
    if "ms" in windowed and "ms" in sdpa:
        row["triton_over_sdpa"] = sdpa["ms"] / windowed["ms"]
    return row


def prefill_row(b: bk.Bench, tokens: int, window: int) -> dict:
    q, kc, vc, bt, cu, cl = bk.prefill_inputs(tokens)
    ref = reference.paged_prefill_attention_ref(q.float(), kc.float(), vc.float(), bt, cu, cl, tokens,
                                                bk.SCALE, sliding_window=window)
    windowed = b.checked("triton, window", lambda: kernels.paged_prefill_attention.triton(
        q, kc, vc, bt, cu, cl, tokens, bk.SCALE, sliding_window=window), lambda o: bk.rel_err(o, ref))
    k = kc[bt.long()].view(1, tokens, bk.HKV, bk.D).transpose(1, 2).repeat_interleave(bk.HQ // bk.HKV, 1).contiguous()
    v = vc[bt.long()].view(1, tokens, bk.HKV, bk.D).transpose(1, 2).repeat_interleave(bk.HQ // bk.HKV, 1).contiguous()
    q4 = q.transpose(0, 1)[None].contiguous()
    pos = torch.arange(tokens, device=q.device)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)

    def sdpa_masked():
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=bk.SCALE)

    def sdpa_causal():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q4, k, v, is_causal=True, scale=bk.SCALE)
    masked = b.checked("torch sdpa, same mask (efficient)", sdpa_masked, lambda o: bk.rel_err(o[0].transpose(0, 1), ref))
    causal = b.checked("torch sdpa flash, whole causal prompt", sdpa_causal, lambda o: 0.0)
    pairs = sum(min(i + 1, window) for i in range(tokens))
    row = {"tokens": tokens, "window": window, "flops": 4 * bk.HQ * bk.D * pairs, "rows": [windowed, masked, causal]}
    if "ms" in windowed and "ms" in masked:
        row["triton_over_sdpa_masked"] = masked["ms"] / windowed["ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.manual_seed(0)
    b = bk.Bench(quick=True, graphs=True)
    ceil = bk.measure_ceilings(b)
    print(f"{torch.cuda.get_device_name()}  copy {ceil['copy_GBps']:.0f} GB/s")
    result = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), **ceil,
              "decode": [], "prefill": None}
    for batch, ctx, window in DECODE:
        r = decode_row(b, batch, ctx, window, ceil["copy_GBps"])
        result["decode"].append(r)
        us = {x["variant"]: (f"{x['ms'] * 1e3:8.1f}" if "ms" in x else x["error"][:60]) for x in r["rows"]}
        print(f"decode {batch:4d} x {ctx:6d}, window {window:5d}: " + "  ".join(f"{k}: {v} us" for k, v in us.items())
              + f"  floor {r['floor_us']:.1f} us  sdpa/triton {r.get('triton_over_sdpa', float('nan')):.2f}", flush=True)
    plain = bk.Bench(quick=True)  # prefill: do_bench (the engine runs long prefills eagerly)
    r = prefill_row(plain, *PREFILL)
    result["prefill"] = r
    us = {x["variant"]: (f"{x['ms'] * 1e3:8.1f}" if "ms" in x else x["error"][:60]) for x in r["rows"]}
    print(f"prefill {PREFILL[0]} tokens, window {PREFILL[1]}: " + "  ".join(f"{k}: {v} us" for k, v in us.items())
          + f"  sdpa(masked)/triton {r.get('triton_over_sdpa_masked', float('nan')):.2f}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
