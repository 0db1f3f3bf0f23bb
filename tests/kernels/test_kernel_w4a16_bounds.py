"""w4a16_matmul reads nothing past the end of its inputs, on every path: each input (activations,
words, scales, zeros and act-order's permutation) ends where an unreadable page begins, so a load
past it (masked lanes whose addresses are still dereferenced, say) kills the process. The CPU
interpreter dereferences what the kernel loads, which is what makes this visible here; the
kernels run in a child process so that such a crash fails the test and names the config."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kernel_checks import ON_GPU

ROOT = Path(__file__).resolve().parents[2]

# (rows, N, K, group, config): K slices that start inside a group and end at K, a prefetching
# and a fused-sum GEMV, the several-row GEMV, the tensor-core kernel split along K, dequantise.
CONFIGS = [
    (1, 64, 256, 128, "W4A16Config(1, 64, 16, 3, 1, 1, 1, method='gemv')"),
    (1, 64, 256, 128, "W4A16Config(1, 64, 16, 3, 1, 1, 1, method='gemv', prefetch=2)"),
    (1, 64, 256, 128, "W4A16Config(1, 64, 16, 3, 1, 1, 1, method='gemv', fused_reduce=True)"),
    (3, 64, 256, 128, "W4A16Config(4, 64, 16, 3, 1, 1, 1, method='gemv')"),
    (5, 64, 256, 128, "W4A16Config(16, 32, 64, 3, 1, 4, 2)"),
    (20, 64, 256, 128, "W4A16Config(64, 128, 64, 0, 8, 4, 4, method='dequant')"),
]

CHILD = textwrap.dedent("""
    import ctypes, mmap, sys
    import torch
    from tritium import kernels
    from tritium.kernels.w4a16 import W4A16Config
    from test_kernel_w4a16 import _case, rel_err

    PAGE, KEEP = mmap.PAGESIZE, []

    def guarded(t):
        # A copy of t whose last byte is the last before a page nothing may read.
        size = t.numel() * t.element_size()
        pages = -(-size // PAGE)
        buf = mmap.mmap(-1, (pages + 1) * PAGE)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        assert ctypes.CDLL(None).mprotect(ctypes.c_void_p(addr + pages * PAGE), PAGE, 0) == 0
        KEEP.append(buf)
        out = torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=pages * PAGE - size).view(t.shape)
        out.copy_(t)
        return out

    for m, n, k, group, config in {configs!r}:
        print("running", config, flush=True)
        (x, qweight, scales, zeros), perm, oracle = _case(m, n, k, group, 4, True, 7, torch.float16)
        out = kernels.w4a16_matmul.triton(guarded(x), guarded(qweight), guarded(scales), guarded(zeros), group,
                                   guarded(perm), config=eval(config))
        assert rel_err(out, oracle) < 2e-3, (config, rel_err(out, oracle))
    print("all in bounds")
""")


@pytest.mark.skipif(ON_GPU, reason="the guard pages are host memory, read by the CPU interpreter")
def test_no_path_reads_past_its_inputs():
    code = CHILD.format(configs=CONFIGS)
    # Started in this folder, so that `python -c` imports test_kernel_w4a16 beside this file.
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tests" / "kernels", capture_output=True,
                         text=True, timeout=600)
    started = [line for line in run.stdout.splitlines() if line.startswith("running")]
    assert run.returncode == 0 and run.stdout.strip().endswith("all in bounds"), (
        f"exit {run.returncode} in {started[-1] if started else 'setup'}\n{run.stderr[-2000:]}")
