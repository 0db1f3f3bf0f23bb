"""Compile w4a16_matmul for sm_90 without a GPU, as hopper_compile.py does for the other kernels:
the default config of every row bucket at Llama-3-8B's shapes (4 bits, groups of 128), with a
shuffled input order, 8 bits, fp16; with `--tuned`, every tuned config in
kernels/configs/w4a16.json instead. One JSON line per launch. Run without TRITON_INTERPRET."""

import os
import sys
from pathlib import Path

import torch

import hopper_compile  # this file's folder: run as a script, or by pytest's rootdir-less import


def cases():
    """Each row bucket's default config and one case per GEMV variant, bit width and dtype."""
    from tritium import kernels
    e = torch.empty
    n, k, group = 6144, 4096, 128
    w = e(k, n // 8, dtype=torch.int32)
    s, z = e(k // group, n, dtype=torch.float16), e(k // group, n, dtype=torch.float16)
    perm = e(k, dtype=torch.int32)
    for m in (1, 16, 64, 256, 4096):
        yield f"w4a16 m={m}", lambda m=m: kernels.w4a16_matmul.triton(e(m, k, dtype=torch.bfloat16), w, s, z, group)
    yield "w4a16 m=1 act-order", lambda: kernels.w4a16_matmul.triton(e(1, k, dtype=torch.bfloat16), w, s, z, group, perm)
    from tritium.kernels.w4a16 import DEFAULT_CONFIGS
    fused = DEFAULT_CONFIGS[1].__class__(**{**DEFAULT_CONFIGS[1].__dict__, "fused_reduce": True, "num_stages": 3})
    yield "w4a16 m=1 fused reduce", lambda: kernels.w4a16_matmul.triton(e(1, k, dtype=torch.bfloat16), w, s, z, group,
                                                                 config=fused)
    wide = DEFAULT_CONFIGS[1].__class__(1, 1024, 16, 0, 1, 1, 1, method="gemv")  # four words a thread
    yield "w4a16 m=1 wide tiles", lambda: kernels.w4a16_matmul.triton(e(1, k, dtype=torch.bfloat16), w, s, z, group,
                                                               config=wide)
    rows = DEFAULT_CONFIGS[1].__class__(4, 512, 16, 0, 1, 1, 1, method="gemv")
    yield "w4a16 m=4 rows gemv", lambda: kernels.w4a16_matmul.triton(e(4, k, dtype=torch.bfloat16), w, s, z, group,
                                                              config=rows)
    yield "w4a16 m=4096 fp16", lambda: kernels.w4a16_matmul.triton(e(4096, k, dtype=torch.float16), w, s, z, group)
    swapped = DEFAULT_CONFIGS[1].__class__(256, 128, 64, 0, 8, 8, 3, swap_ab=True)  # all 256 rows a program
    yield "w4a16 m=256 swapped", lambda: kernels.w4a16_matmul.triton(e(256, k, dtype=torch.bfloat16), w, s, z, group,
                                                              config=swapped)
    w8 = e(k, n // 4, dtype=torch.int32)
    yield "w8a16 m=16", lambda: kernels.w4a16_matmul.triton(e(16, k, dtype=torch.bfloat16), w8, s, z, group, bits=8)


def tuned_cases():
    """Every tuned config in kernels/configs/w4a16.json, at its own shape and row bucket."""
    from tritium import kernels
    from tritium.kernels.w4a16 import TUNED_CONFIGS, load_tuned_configs
    e = torch.empty
    for gpu, entries in load_tuned_configs(TUNED_CONFIGS).items():
        for key, cfg in entries.items():
            shape, wg, _ = key.split("/")
            tn, tk = (int(v) for v in shape.split("x"))
            bits, tg = (int(v) for v in wg[1:].split("g"))
            yield (f"w4a16 tuned {gpu} {key}", lambda tn=tn, tk=tk, bits=bits, tg=tg, cfg=cfg: kernels.w4a16_matmul.triton(
                e(cfg.block_m, tk, dtype=torch.bfloat16), e(tk, tn * bits // 32, dtype=torch.int32),
                e(tk // tg, tn, dtype=torch.float16), e(tk // tg, tn, dtype=torch.float16), tg, bits=bits, config=cfg))


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET"
    args = hopper_compile.parse_args()
    from tritium.kernels import w4a16
    w4a16.check_runnable = lambda op, t: None
    hopper_compile.compile_cases(tuned_cases() if args.tuned else cases(), args.jobs)


if __name__ == "__main__":
    main()
