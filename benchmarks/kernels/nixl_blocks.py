"""The KV-block transfer under disaggregated prefill, timed: a decode-side process reads a
prompt's blocks from a prefill-side process's paged cache through NIXL
(`backend/kv_transfer/nixl_blocks.py`), against the card's own copy rate (one contiguous
device-to-device copy of the same bytes in one process) and the gather copy the swap path makes
(`index_select` of the same blocks). Llama-3-8B's cache shape by default: 32 layers, 8 KV heads
of 128, blocks of 16 tokens, bf16 (2 MiB a block over the layers).

Each read is timed for every --num-threads (the UCX workers NIXL splits it across) and two block
layouts: "strided", every other block on the peer's side (no two regions adjacent on both sides,
so each (K or V, layer, block) region is an operation of its own, as in a fragmented cache), and
"contiguous", runs NIXL merges into one operation per (K or V, layer).

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
    ap.add_argument("--num-threads", type=int, nargs="+", default=[0, 4])
    ap.add_argument("--layouts", nargs="+", default=["strided", "contiguous"], choices=("strided", "contiguous"))
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
    readers = {t: NixlBlockTransfer(cache, f"decode-{t}", num_threads=t) for t in args.num_threads}
    metadata = here.recv()
    peers = {t: r.add_peer(metadata) for t, r in readers.items()}
    block_bytes = cache[:, :, 0].numel() * cache.element_size()
    rows = []
    for n in args.blocks:
        flat = torch.empty(n * block_bytes // 2, dtype=torch.bfloat16, device=args.device)
        src = torch.ones_like(flat)
        t_copy = _time(lambda: flat.copy_(src), sync, args.repeats)
        del flat, src
        for layout in args.layouts:
            strided = layout == "strided" and 2 * n <= args.cache_blocks
            remote = list(range(0, 2 * n, 2)) if strided else list(range(n))
            local = list(range(n))
            idx = torch.tensor(remote, device=args.device)
            t_gather = _time(lambda: cache.index_select(2, idx), sync, args.repeats)
            for threads, reader in readers.items():
                def nixl_read():
                    handle = reader.read(peers[threads], remote, local)
                    while not reader.poll(handle):
                        pass
                t_nixl = _time(nixl_read, sync, args.repeats)
                ok = bool((cache[:, :, :n, 0, 0, 0] == 2.0).all()) and bool((cache[:, :, :n, 1] == 1.0).all())
                cache.zero_()
                nbytes = n * block_bytes
                rows.append({"blocks": n, "layout": "strided" if strided else "contiguous", "num_threads": threads,
                             "bytes": nbytes, "nixl_s": t_nixl, "nixl_gbs": nbytes / t_nixl / 1e9,
                             "copy_gbs": nbytes / t_copy / 1e9, "gather_gbs": nbytes / t_gather / 1e9, "exact": ok})
    here.send("done")
    proc.join(60)
    for reader in readers.values():
        reader.close()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\nNIXL block reads between two processes, {name}: {args.layers} layers, {args.kv_heads} KV heads "
          f"of {args.head_dim}, blocks of {args.block_size} ({block_bytes / 2**20:.2f} MiB a block)")
    print(f"{'blocks':>7} {'layout':>10} {'threads':>7} {'MiB':>8} {'NIXL ms':>8} {'NIXL GB/s':>10} "
          f"{'copy GB/s':>10} {'gather GB/s':>11} {'NIXL/copy':>9} {'exact':>6}")
    for r in rows:
        print(f"{r['blocks']:>7} {r['layout']:>10} {r['num_threads']:>7} {r['bytes'] / 2**20:>8.0f} "
              f"{r['nixl_s'] * 1e3:>8.3f} {r['nixl_gbs']:>10.1f} "
              f"{r['copy_gbs']:>10.1f} {r['gather_gbs']:>11.1f} {r['nixl_gbs'] / r['copy_gbs']:>9.2f} "
              f"{str(r['exact']):>6}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": name, "args": vars(args), "block_bytes": block_bytes, "rows": rows}, f, indent=2)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
