"""Instructions per weight in the sm_90 SASS of the one-row W4A16 GEMV's hot loop, without a GPU.

Compiles `_w4a16_gemv_kernel` (through `kernels.w4a16_matmul`, which picks its constexprs and
launch options as on the GPU) at Llama-3-8B's four projections (bf16, 4 bits, groups of 128) for
the default one-row config, each H100 config of kernels/configs/w4a16.json, or configs given on
the command line, dumps the SASS with Triton's bundled cuobjdump and prints one row per build:
the K slices (spl), registers and spill bytes; the hot loop (the backward branch whose body
holds the most FFMAs) less any block a forward branch inside it skips (the group epilogue that
applies zeros and scales): its instructions (loop), weights per thread per iteration (wt/it =
BLOCK_K * BLOCK_N / threads) and instructions per weight (ins/wt); the skipped block (epi) and
the total per weight with it run once per group, or per K slice if a slice is shorter (+epi);
then the loop's mix (LOP3, FFMA, FADD, FMUL, shifts, integer and address arithmetic, moves and
constants, conversions, loads by width, SHFL, barriers, shared-memory stores and loads).

    .venv/bin/python -m scripts.probes.gemv_sass                 # default + tuned H100 configs
    .venv/bin/python -m scripts.probes.gemv_sass --config "W4A16Config(1, 1024, 32, 0, 1, 4, 1, method='gemv')"
    .venv/bin/python -m scripts.probes.gemv_sass --sass-dir /tmp/sass   # also keep each SASS listing
    .venv/bin/python -m scripts.probes.gemv_sass --rows 8 --config "W4A16Config(8, 256, 16, 0, 1, 4, 1, method='gemv')"

Run without TRITON_INTERPRET. Needs only the CPU (tests/kernels/hopper_compile.py's launch capture).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch
from triton.runtime.jit import JITFunction

from tests.kernels import hopper_compile

PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);")
# Columns of the mix; an opcode counts in the first class whose test it passes.
CLASSES = [
    ("LOP3", lambda op: op.startswith("LOP3")), ("FFMA", lambda op: op.startswith("FFMA")),
    ("FADD", lambda op: op.startswith("FADD")), ("FMUL", lambda op: op.startswith("FMUL")),
    ("SHF", lambda op: op.startswith(("SHF", "SGXT", "PRMT", "BFE"))),
    ("int", lambda op: op.startswith(("IMAD", "IADD", "LEA", "VIADD", "ISETP", "SEL", "UIADD", "UIMAD",
                                      "ULEA", "USHF", "ULOP", "UMOV", "ISCADD"))),
    ("MOV", lambda op: op.startswith(("MOV", "CS2R", "HFMA2.MMA", "S2R", "S2UR", "LDC", "ULDC", "R2UR"))),
    ("cvt", lambda op: op.startswith(("HADD2", "HFMA2", "HMUL2", "F2F", "I2F", "F2I", "PRMT"))),
    ("LDG", lambda op: op.startswith("LDG")), ("LDGSTS", lambda op: op.startswith("LDGSTS")),
    ("SHFL", lambda op: op.startswith("SHFL")), ("BAR", lambda op: op.startswith(("BAR", "DEPBAR", "LDGDEPBAR"))),
    ("STS", lambda op: op.startswith("STS")), ("LDS", lambda op: op.startswith(("LDS", "LDSM"))),
]


def cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([str(hopper_compile.CUOBJDUMP), flag, f.name], capture_output=True,
                              text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def resources(cubin: bytes) -> tuple[int, int]:
    """Registers and spill (local memory) bytes a thread uses."""
    m = re.search(r"REG:(\d+) STACK:(\d+).*LOCAL:(\d+)", cuobjdump(cubin, "-res-usage"))
    return int(m.group(1)), int(m.group(2)) + int(m.group(3))


def instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of each instruction, in order."""
    return [(int(m.group(1), 16), m.group(3), m.group(4).strip()) for m in map(LINE.search, sass.splitlines()) if m]


def loops(code: list[tuple[int, str, str]]) -> list[tuple[int, int]]:
    """(first, last) address of each backward branch's range."""
    out = []
    for addr, op, args in code:
        if op.startswith("BRA") and (m := re.match(r"0x([0-9a-f]+)", args)) and int(m.group(1), 16) < addr:
            out.append((int(m.group(1), 16), addr))
    return out


def hot_loop(code: list[tuple[int, str, str]]) -> tuple[list, list]:
    """The smallest loop whose body holds the most FFMAs, split into the instructions every
    iteration runs and those a forward branch inside it skips (the GEMV's group epilogue, run
    once per group of K rows); both empty when there is no loop."""
    ranges = loops(code)
    if not ranges:
        return [], []
    body = lambda r: [i for i in code if r[0] <= i[0] <= r[1]]  # noqa: E731
    first, last = max(ranges, key=lambda r: (sum(i[1].startswith("FFMA") for i in body(r)), r[0] - r[1]))
    skipped = []
    for addr, op, args in body((first, last)):
        m = re.search(r"0x([0-9a-f]+)\s*$", args)
        if op.startswith("BRA") and m and addr < int(m.group(1), 16) <= last:
            skipped.append((addr + 16, int(m.group(1), 16) - 16))
    cold = [i for i in body((first, last)) if any(a <= i[0] <= b for a, b in skipped)]
    return [i for i in body((first, last)) if i not in cold], cold


def mix(body: list[tuple[int, str, str]]) -> dict[str, int]:
    counts: dict[str, int] = collections.Counter()
    for _, op, _ in body:
        counts[next((name for name, test in CLASSES if test(op)), "other")] += 1
    for _, op, _ in body:
        if op.startswith(("LDG", "LDS", "STS")):
            width = op.replace(".E", "").replace(".CONSTANT", "")
            counts[width if "." in width else width + ".32"] += 1
    return dict(counts)


def probe(label: str, n: int, k: int, cfg, sass_dir: str | None, rows: int = 1) -> dict:
    from tritium import kernels
    hopper_compile.launches.clear()
    e = torch.empty
    kernels.w4a16_matmul.triton(e(rows, k, dtype=torch.bfloat16), e(k, n // 8, dtype=torch.int32),
                         e(k // GROUP, n, dtype=torch.float16), e(k // GROUP, n, dtype=torch.float16), GROUP,
                         config=cfg)
    fn, args, kwargs = hopper_compile.launches[0]  # the GEMV (a K-slice sum may follow)
    kernel = hopper_compile.compile_kernel(fn, args, kwargs)
    sass = cuobjdump(kernel.asm["cubin"], "-sass")
    if sass_dir:
        os.makedirs(sass_dir, exist_ok=True)
        Path(sass_dir, f"{label}.sass".replace(" ", "_").replace("/", "-")).write_text(sass)
    body, rest = hot_loop(instructions(sass))
    threads = 32 * kwargs["num_warps"]
    weights = kwargs["BLOCK_K"] * kwargs["BLOCK_W"] * 8 // threads
    # The skipped block runs once per group, or per K slice when a slice is shorter.
    slice_rows = min(GROUP, args[fn.arg_names.index("K_SLICE")]) if "K_SLICE" in fn.arg_names else GROUP
    per_group = len(rest) / (weights * slice_rows // kwargs["BLOCK_K"])
    regs, spills = resources(kernel.asm["cubin"])
    return {"case": label, "n": n, "k": k, "block_n": cfg.block_n,
            "block_k": kwargs["BLOCK_K"], "warps": kwargs["num_warps"], "stages": kwargs["num_stages"],
            "split": kwargs.get("SPLIT_K", len(hopper_compile.launches)), "registers": regs, "spills": spills,
            "loop": len(body), "weights": weights, "per_weight": round(len(body) / max(weights, 1), 2),
            "epilogue": len(rest), "per_weight_all": round(len(body) / max(weights, 1) + per_group, 2),
            "mix": mix(body)}


def configs(args) -> list[tuple[str, object]]:
    from tritium.kernels.w4a16 import DEFAULT_CONFIGS, TUNED_CONFIGS, W4A16Config, config_key, load_tuned_configs
    if args.config:
        return [(f"cfg{i}", eval(c, {"W4A16Config": W4A16Config})) for i, c in enumerate(args.config)]
    out = [("default", DEFAULT_CONFIGS[1])]
    for gpu, table in load_tuned_configs(TUNED_CONFIGS).items():
        if "H100" in gpu:
            out += [(f"tuned {name}", table.get(config_key(n, k, 4, GROUP, 1)))
                    for name, (n, k) in PROJECTIONS.items()]
    return out


MIX = ("LOP3", "FFMA", "FADD", "FMUL", "SHF", "int", "MOV", "cvt", "LDG", "LDGSTS", "SHFL", "BAR", "STS", "LDS")
HEADER = ("config", "proj", "bn", "bk", "w", "st", "spl", "regs", "spill", "loop", "wt/it", "ins/wt", "epi", "+epi")


def line(name: str, r: dict) -> str:
    values = (name[:18], r["case"].split()[-1], r["block_n"], r["block_k"], r["warps"], r["stages"], r["split"],
              r["registers"], r["spills"], r["loop"], r["weights"], r["per_weight"], r["epilogue"],
              r["per_weight_all"]) + tuple(r["mix"].get(c, 0) for c in MIX)
    loads = " ".join(f"{op}x{c}" for op, c in sorted(r["mix"].items()) if op.startswith(("LDG.", "LDS", "STS")))
    return f"{values[0]:18} {values[1]:8} " + " ".join(f"{v:>6}" for v in values[2:]) + f"  {loads}"


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET"
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", action="append", help="a W4A16Config(...) expression (repeatable)")
    ap.add_argument("--only", help="one projection (qkv, o, gate_up, down)")
    ap.add_argument("--sass-dir", help="write each build's SASS listing here")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--rows", type=int, default=1, help="activation rows (a config's block_m for the several-row GEMV)")
    args = ap.parse_args()
    JITFunction.run = hopper_compile._record
    from tritium.kernels import w4a16
    w4a16.check_runnable = lambda op, t: None
    rows = []
    print(f"{HEADER[0]:18} {HEADER[1]:8} " + " ".join(f"{h:>6}" for h in HEADER[2:] + MIX) + "  loads")
    for name, cfg in configs(args):
        for proj, (n, k) in PROJECTIONS.items():
            wanted = (not args.only or proj == args.only) and (not name.startswith("tuned ") or proj == name.split()[1])
            if cfg is not None and wanted:
                rows.append(probe(f"{name} {proj}", n, k, cfg, args.sass_dir, args.rows))
                print(line(name, rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
