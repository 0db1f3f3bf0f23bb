"""The KV-block transfer under disaggregated prefill, timed: a decode-side process reads a
prompt's blocks from a prefill-side process's paged cache through NIXL
(`backend/kv_transfer/nixl_blocks.py`), against the card's own copy rate (one contiguous
device-to-device copy of the same bytes in one process) and the gather copy the swap path makes
(`index_select` of the same blocks). Llama-3-8B's cache shape by default: 32 layers, 8 KV heads
of 128, blocks of 16 tokens, bf16 (2 MiB a block over the layers).

    python benchmarks/kernels/nixl_blocks.py --blocks 64 256 1024 --json out.json
    python benchmarks/kernels/nixl_blocks.py --device cpu --cache-blocks 64 --blocks 16   # (host memory)
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time


def _cache(args, device: str, fill: float):
    import torch
    shape = (2, args.layers, args.cache_blocks, args.block_size, args.kv_heads, args.head_dim)
    return torch.full(shape, fill, dtype=torch.bfloat16, device=device)


def _producer(args, conn) -> None:
    from tritium.kv_transfer.nixl_blocks import NixlBlockTransfer
    cache = _cache(args, args.device, 1.0)
    cache[:, :, :, 0, 0, 0] = 2.0  # a mark per block, checked on arrival
    transfer = NixlBlockTransfer(cache, "prefill")
    conn.send(transfer.metadata())
    conn.recv()
    transfer.close()


def _time(fn, sync, repeats: int) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--cache-blocks", type=int, default=2048)
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import torch

    from tritium.kv_transfer.nixl_blocks import NixlBlockTransfer
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(args, there))
    proc.start()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    cache = _cache(args, args.device, 0.0)
    transfer = NixlBlockTransfer(cache, "decode")
    peer = transfer.add_peer(here.recv())
    block_bytes = cache[:, :, 0].numel() * cache.element_size()
    rows = []
    for n in args.blocks:
        remote = list(range(0, 2 * n, 2))[:n] if 2 * n <= args.cache_blocks else list(range(n))
        local = list(range(n))

        def nixl_read():
            handle = transfer.read(peer, remote, local)
            while not transfer.poll(handle):
                pass
        t_nixl = _time(nixl_read, sync, args.repeats)
        ok = bool((cache[:, :, :n, 0, 0, 0] == 2.0).all()) and bool((cache[:, :, :n, 1] == 1.0).all())
        cache.zero_()
        flat = torch.empty(n * block_bytes // 2, dtype=torch.bfloat16, device=args.device)
        src = torch.ones_like(flat)
        t_copy = _time(lambda: flat.copy_(src), sync, args.repeats)
        idx = torch.tensor(remote, device=args.device)
        t_gather = _time(lambda: cache.index_select(2, idx), sync, args.repeats)
        nbytes = n * block_bytes
        rows.append({"blocks": n, "bytes": nbytes, "nixl_s": t_nixl, "nixl_gbs": nbytes / t_nixl / 1e9,
                     "copy_gbs": nbytes / t_copy / 1e9, "gather_gbs": nbytes / t_gather / 1e9, "exact": ok})
        del flat, src
    here.send("done")
    proc.join(60)
    transfer.close()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\nNIXL block reads between two processes, {name}: {args.layers} layers, {args.kv_heads} KV heads "
          f"of {args.head_dim}, blocks of {args.block_size} ({block_bytes / 2**20:.2f} MiB a block)")
    print(f"{'blocks':>7} {'MiB':>8} {'NIXL ms':>8} {'NIXL GB/s':>10} {'copy GB/s':>10} {'gather GB/s':>11} "
          f"{'NIXL/copy':>9} {'exact':>6}")
    for r in rows:
        print(f"{r['blocks']:>7} {r['bytes'] / 2**20:>8.0f} {r['nixl_s'] * 1e3:>8.3f} {r['nixl_gbs']:>10.1f} "
              f"{r['copy_gbs']:>10.1f} {r['gather_gbs']:>11.1f} {r['nixl_gbs'] / r['copy_gbs']:>9.2f} "
              f"{str(r['exact']):>6}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": name, "args": vars(args), "block_bytes": block_bytes, "rows": rows}, f, indent=2)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
