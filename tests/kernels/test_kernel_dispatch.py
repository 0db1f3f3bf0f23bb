"""Where kernels run: importing `kernels` must not import Triton (Triton fixes interpreter mode
at import), and CPU tensors without the interpreter get a clear error naming the reference."""

import os
import subprocess
import sys
from pathlib import Path

from kernel_checks import ON_GPU

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys, torch, kernels
assert "triton" not in sys.modules, "import kernels imported triton"
try:
    kernels.silu_and_mul(torch.randn(2, 8))
except ValueError as e:
    print(e)
"""


def test_cpu_tensors_without_interpreter_name_the_reference():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "silu_and_mul: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), "
        "got cpu; on the CPU use kernels.reference.silu_and_mul_ref")


def test_this_process_runs_kernels_where_the_tests_expect():
    import kernels._launch as launch
    # On a GPU machine the tests run compiled; without one, conftest.py turned the interpreter on.
    assert launch.INTERPRETED is (not ON_GPU)
