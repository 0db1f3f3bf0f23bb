"""Compile w4a16_fragment_matmul for sm_90 without a GPU (Llama-3-8B's qkv shape, bf16, groups of
128) for SLABS, BLOCK_M, the widening ("paired" PTX, or "tl") and KSTEPS given on the command line,
and print what its K loop holds in the PTX: wgmma instructions, waits for every MMA in flight
(`wait_group 0`: none, or no MMA overlaps the next step's widening), shared-memory stores and
loads, and the build's registers and spill bytes.
Run without TRITON_INTERPRET."""

import re
import sys

import hopper_compile  # this file's folder: run as a script
import torch
from triton.runtime.jit import JITFunction


def main() -> None:
    slabs, block_m, paired, ksteps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "paired", int(sys.argv[4])
    JITFunction.run = hopper_compile._record
    from tritium.kernels import w4a16_fragment as f
    f.check_runnable = lambda op, t: None
    f.paired_dequant = lambda x: paired
    e = torch.empty
    n, k = 6144, 4096
    s = e(k // 128, n, dtype=torch.float16)
    f.w4a16_fragment_matmul(e(block_m, k, dtype=torch.bfloat16), e(k // 64, n // 64, 128, 4, dtype=torch.int32), s, s,
                            128, config=f.FragmentConfig(block_m=block_m, slabs=slabs, split_k=1, ksteps=ksteps))
    fn, args, kwargs = hopper_compile.launches[0]
    info = hopper_compile.compile_launch(fn, args, kwargs)
    ptx = hopper_compile.compile_kernel(fn, args, kwargs).asm["ptx"].splitlines()
    head = next(i for i, line in enumerate(ptx) if "Inner Loop Header" in line)
    label = ptx[head].split(":")[0].strip()
    end = next(i for i in range(head + 1, len(ptx)) if re.search(rf"bra(\.uni)?\s+{re.escape(label)};", ptx[i]))
    body = ptx[head:end + 1]
    count = lambda s: sum(s in line for line in body)  # noqa: E731
    print(f"wgmma={count('wgmma.mma_async')} wait0={count('wgmma.wait_group.sync.aligned 0;')} st_shared={count('st.shared')} ld_shared={count('ld.shared')} "
          f"registers={info.get('registers')} spills={info.get('local_bytes', 0) + info.get('stack_bytes', 0)}")


if __name__ == "__main__":
    main()
