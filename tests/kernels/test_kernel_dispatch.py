"""Where kernels run: importing `kernels` must not import Triton (Triton fixes interpreter mode
at import), and CPU tensors without the interpreter get a clear error naming the reference. The op
table (`kernels/ops.py`) declares each op once: its launcher and its reference take the same
arguments, and calling an op picks between them by device."""

import os
import subprocess
import sys
from pathlib import Path

from kernel_checks import ON_GPU

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys, torch, kernels
assert "triton" not in sys.modules, "importing tritium.kernels imported triton"
try:
    kernels.silu_and_mul.triton(torch.randn(2, 8))
except ValueError as e:
    print(e)
"""


def test_cpu_tensors_without_interpreter_name_the_reference():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "silu_and_mul: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), "
        "got cpu; on the CPU use kernels.reference.silu_and_mul_ref")


def test_this_process_runs_kernels_where_the_tests_expect():
    from tritium.kernels import _launch as launch
    # On a GPU machine the tests run compiled; without one, conftest.py turned the interpreter on.
    assert launch.INTERPRETED is (not ON_GPU)


def test_each_op_has_one_launcher_and_a_reference_with_its_arguments():
    """The launcher takes the reference's parameters, in order, with the same defaults, and
    only tuning options besides (keyword-only: the benchmarks' sweeps)."""
    import inspect

    from tritium.kernels.ops import OPS
    tuning = {"config", "num_warps", "block", "block_m", "block_n", "max_context_len"}
    assert len(OPS) == 17
    for name, op in OPS.items():
        assert op.reference.__name__ == f"{name}_ref" and op.triton.__name__ == name
        launcher = [p for p in inspect.signature(op.triton).parameters.values()
                    if p.kind != p.VAR_KEYWORD and p.name not in tuning]
        ref = [p for p in inspect.signature(op.reference).parameters.values() if p.kind != p.VAR_KEYWORD]
        assert [(p.name, p.kind, p.default) for p in launcher] == [(p.name, p.kind, p.default) for p in ref], name
        assert all(p.kind == p.KEYWORD_ONLY for p in inspect.signature(op.triton).parameters.values()
                   if p.name in tuning), name


def test_calling_an_op_runs_the_reference_on_the_cpu_and_the_kernel_on_request():
    import torch

    from tritium import kernels
    from tritium.kernels import reference
    from tritium.kernels.ops import KernelOp
    x = torch.randn(3, 16)
    weight = torch.rand(16) + 0.5
    want = reference.rms_norm_ref(x, weight, 1e-6)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-6), want)
    marked = KernelOp("rms_norm", "norm", lambda *args: "reference")
    assert marked(x, weight, 1e-6) == "reference"
    device = "cuda" if ON_GPU else "cpu"  # (the interpreter runs Triton programs on the CPU)
    got = marked.triton(x.to(device), weight.to(device), 1e-6)
    assert torch.allclose(got.cpu(), want, atol=1e-5)
    if ON_GPU:
        assert torch.allclose(marked(x.cuda(), weight.cuda(), 1e-6).cpu(), want, atol=1e-5)


def test_the_table_is_the_only_dispatch():
    """backend/ calls ops as `kernels.<op>(...)`: it never names an op's reference or its launcher
    (the device choice lives in kernels/ops.py alone)."""
    import re

    from tritium.kernels.ops import OPS
    names = "|".join(OPS)
    pattern = re.compile(rf"\b({names})_ref\b|\bkernels\.({names})\.triton\b|from tritium\.kernels\.(\w+) import ({names})\b")
    found = []
    for path in sorted((ROOT / "backend").rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []
    assert not (ROOT / "backend" / "layers" / "ops.py").exists()
