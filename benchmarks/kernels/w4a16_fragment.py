"""The W4A16 matmul on fragment-ordered words (kernels/w4a16_fragment.py) against cuBLAS bf16 and
the packed layout's path (kernels/w4a16.py at the config it picks), at Llama-3-8B's four
projections and 1-4096 rows: a few kernel configs per row count and the dequantize-then-GEMM path,
each checked against the packed path before it is timed. Weights from DRAM (copies cycled past
L2), CUDA-graph timing.

--write-configs PATH: for each shape whose fastest fragment paths, summed over the row counts,
beat the packed layout's (and are at most 5% behind it at one row, batch-1 decode's only row
count), the fastest per row bucket goes into PATH's table for this card (the
engine then repacks that shape into the fragment layout); other shapes leave it. Written after
each shape, so a run cut short keeps what it measured.

    python3 benchmarks/kernels/w4a16_fragment.py [--rows 1,8,16,64,256,512,4096] [--layers gate_up]
        [--json OUT] [--write-configs kernels/configs/w4a16_fragment.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
from fp8_matmul import linear_shapes  # (this script's folder, as benchmarks/kernels/w4a16.py imports it)
from w4a16 import COLD_BYTES, cycling, time_us

from tritium import kernels
from tritium.kernels.w4a16_fragment import FragmentConfig, repack_fragment
from tritium.kernels.w4a16_fragment_layout import config_entry, config_key, row_bucket

GROUP = 128
ROWS = (1, 8, 16, 64, 256, 512, 4096)


def configs(m: int) -> list[FragmentConfig]:
    """A few tiles for m rows: one row tile where it holds them all, K slices automatic or none."""
    # At a few rows a program's words are its only traffic: deeper pipelines (stages, two K steps
    # an iteration, K slices for more programs) keep more of them in flight. Four slabs (256
    # columns a program) read the activations a quarter as often as one: at 64+ rows those
    # re-reads from L2 are most of a program's traffic.
    if m <= 64:
        bm = 16 if m <= 16 else 64
        extra = [FragmentConfig(block_m=bm, split_k=2, num_stages=4, ksteps=2)]
        extra += [FragmentConfig(block_m=64, slabs=4, ksteps=2)] if m > 16 else []
        return [FragmentConfig(block_m=bm, slabs=s, num_stages=st, ksteps=ks)
                for s in (1, 2) for st in (3, 5) for ks in (1, 2)] + extra
    return [FragmentConfig(block_m=bm, slabs=s, split_k=sp, ksteps=2)
            for bm, s in ((128, 1), (128, 2), (128, 4), (256, 1), (256, 2)) for sp in (0, 1)]


def cfg_name(cfg: FragmentConfig) -> str:
    if cfg.method == "dequant":
        return "dequant"
    return f"m{cfg.block_m} slabs{cfg.slabs} s{cfg.split_k} st{cfg.num_stages} ks{cfg.ksteps}"


def write_configs(path: str, gpu: str, entries: dict[str, dict], dropped: list[str]) -> None:
    """Merge a shape's entries into the table for this card (dropped: prefixes of shapes that
    lost to the packed layout, whose entries go)."""
    table = {"configs": {}}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    mine = table.setdefault("configs", {}).setdefault(gpu, {})
    for prefix in dropped:
        for key in [k for k in mine if k.startswith(prefix)]:
            del mine[key]
    mine.update(entries)
    if not mine:
        del table["configs"][gpu]
    table.setdefault("provenance", {})[gpu] = (
        f"{datetime.date.today().isoformat()} by benchmarks/kernels/w4a16_fragment.py --write-configs: the shapes "
        "whose fragment paths beat the packed layout summed over 1-4096 rows, the fastest path per row bucket")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")


def pack_along_n(q: torch.Tensor) -> torch.Tensor:
    """[K, N] values 0..15 -> kernels/w4a16.py's words [K, N / 8] (column 8c + j in bits 4j)."""
    k, n = q.shape
    v = q.to(torch.int64).reshape(k, n // 8, 8)
    words = sum(v[..., j] << (4 * j) for j in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--json")
    ap.add_argument("--write-configs", metavar="PATH")
    ap.add_argument("--layers", help="comma-separated projections to time (qkv,o,gate_up,down; all by default)")
    a = ap.parse_args()
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}; {a.model}; 4-bit weights, groups of {GROUP}, bf16 activations; weights from DRAM (copies cycled)")
    print(f"{'layer':8} {'N x K':>13} {'M':>5} {'bf16 us':>8} {'engine us':>9} {'fragment us':>11} {'vs bf16':>7} "
          f"{'vs engine':>9}  best fragment config")
    results = []
    shapes = linear_shapes(a.model)
    for layer, (n, k) in ((name, shapes[name]) for name in (a.layers.split(",") if a.layers else shapes)):
        q = torch.randint(0, 16, (k, n), device="cuda")
        scales = (torch.rand(k // GROUP, n, device="cuda") * 1e-3 + 1e-3).half()
        zeros = torch.randint(0, 16, (k // GROUP, n), device="cuda").half()
        packed, frag = pack_along_n(q), repack_fragment(q)
        w16 = ((q.T.float() - zeros.float().repeat_interleave(GROUP, 0).T) * scales.float().repeat_interleave(GROUP, 0).T).bfloat16()
        del q
        next_frag = cycling(lambda: frag.clone(), frag.numel() * 4, False)
        next_packed = cycling(lambda: packed.clone(), packed.numel() * 4, False)
        next_w16 = cycling(lambda: w16.clone(), w16.numel() * 2, False)
        chosen, fragment_sum, packed_sum, one_row = {}, 0.0, 0.0, (0.0, 0.0)
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t16 = time_us(lambda: torch.nn.functional.linear(x, next_w16()))
            want = kernels.w4a16_matmul.triton(x, packed, scales, zeros, GROUP)
            t_engine = time_us(lambda: kernels.w4a16_matmul.triton(x, next_packed(), scales, zeros, GROUP))
            timed, by_name = {}, {}
            for cfg in configs(m) + [FragmentConfig(method="dequant")]:
                name = cfg_name(cfg)
                by_name[name] = cfg
                try:
                    got = kernels.w4a16_fragment_linear.triton(x, frag, scales, zeros, GROUP, config=cfg)
                    diff = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                    if not diff < 2e-2:
                        timed[name] = f"wrong (relative difference {diff:.2e})"
                        continue
                    timed[name] = time_us(lambda cfg=cfg: kernels.w4a16_fragment_linear.triton(
                        x, next_frag(), scales, zeros, GROUP, config=cfg))
                except Exception as exc:  # (a config over the card's shared memory, say)
                    timed[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
            numbers = {c: t for c, t in timed.items() if isinstance(t, float)}
            best = min(numbers, key=numbers.get) if numbers else None
            tb = numbers.get(best, float("nan"))
            if best is not None:
                chosen[config_key(n, k, GROUP, row_bucket(m))] = config_entry(by_name[best])
            fragment_sum, packed_sum = fragment_sum + tb, packed_sum + t_engine
            if m == 1:
                one_row = (tb, t_engine)
            results.append({"layer": layer, "n": n, "k": k, "rows": m, "bf16_us": t16, "engine_us": t_engine,
                            "fragment_best_us": tb, "fragment_best": best, "fragment": timed})
            print(f"{layer:8} {n:>5} x {k:<5} {m:>5} {t16:8.1f} {t_engine:9.1f} {tb:11.1f} {t16 / tb:6.2f}x "
                  f"{t_engine / tb:8.2f}x  {best}", flush=True)
        # Summed over the row counts, and not more than 5% behind at one row: batch-1 decode
        # (workload B) runs only that row count, and the layout is one for all of them.
        # (nan: a row count with no working config never wins.)
        wins = fragment_sum < packed_sum and not one_row[0] > 1.05 * one_row[1]
        print(f"{layer}: fragment paths {fragment_sum:.1f} us summed, packed layout {packed_sum:.1f} us: "
              f"{'the fragment layout' if wins else 'the packed layout'} for {n}x{k}", flush=True)
        if a.write_configs:
            write_configs(a.write_configs, gpu, chosen if wins else {}, [] if wins else [f"{n}x{k}/w4g{GROUP}/"])
        if a.json:
            with open(a.json, "w", encoding="utf-8") as f:
                json.dump({"gpu": gpu, "model": a.model, "group_size": GROUP, "cold_bytes": COLD_BYTES,
                           "results": results}, f, indent=1)
        del frag, packed, w16
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
