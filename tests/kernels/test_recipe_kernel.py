"""The kernel recipe of docs/architecture.md ("How to add ... A kernel"), followed in a temporary
place: a kernel module with a private `@triton.jit` function and a wrapper, named as the op, that
checks its arguments (its check in kernels/validation_ops.py); its reference, `<name>_ref` in
kernels/reference.py; its KernelOp in OPS, which kernels/__init__.py exports as `kernels.<name>`;
a layer calling it. The op gives the reference on CPU tensors, `.triton` the kernel (Triton's
interpreter on the CPU), which matches a float64 oracle. Then the conventions the recipe states,
on every op there is."""
from __future__ import annotations

import importlib
import inspect
import sys

import pytest
import torch

NAME, MODULE = "scaled_add", "recipe_scaled_add"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)

# Step 1: kernels/<module>.py, named apart from the op.
KERNEL_MODULE = '''"""scaled_add: out = x + alpha * y, element-wise, computed in float32."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import validation, validation_ops
from ._launch import cdiv, check_runnable

OP = "scaled_add"


@triton.jit
def _scaled_add_kernel(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x + alpha * y).to(out_ptr.dtype.element_ty), mask=mask)


def scaled_add(x: torch.Tensor, y: torch.Tensor, alpha: float, *, block: int = 64) -> torch.Tensor:
    """x, y [T, H] -> x + alpha * y [T, H]."""
    validation_ops.check_scaled_add(OP, x, y, validation.HALF_AND_FLOAT)
    check_runnable(OP, x)
    out = torch.empty_like(x)
    if x.numel():
        _scaled_add_kernel[(cdiv(x.numel(), block),)](x, y, out, float(alpha), x.numel(), BLOCK=block)
    return out
'''


def check_scaled_add(op: str, x, y, dtypes: tuple[torch.dtype, ...]) -> None:
    """The op's argument check, as kernels/validation_ops.py would hold it."""
    from tritium.kernels import validation
    validation.check_tensor(op, "x", x, "[T, H]", dtypes)
    validation.check_contiguous(op, "x", x)
    validation.check_tensor(op, "y", y, "[T, H]", dtypes)
    validation.check_shape(op, "y", y, tuple(x.shape), "x.shape")
    validation.check_same_dtype(op, "y", y, "x", x)
    validation.check_contiguous(op, "y", y)
    validation.check_same_device(op, {"x": x, "y": y})


def scaled_add_ref(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    """Step 2's reference: the wrapper's signature, plain PyTorch."""
    from tritium.kernels import validation
    check_scaled_add(NAME, x, y, validation.REFERENCE_DTYPES)
    return (x.float() + alpha * y.float()).to(x.dtype) if x.dtype != torch.float64 else x + alpha * y


class ScaledResidual(torch.nn.Module):
    """Step 3: the layer that calls `kernels.<name>(...)`."""

    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.alpha = alpha

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        from tritium import kernels
        return kernels.scaled_add(hidden, residual, self.alpha)


@pytest.fixture
def scaled_add_op(monkeypatch, tmp_path, request):
    """The op added as the recipe says, undone at the end: its module in a folder searched as
    part of the kernels package, its check and reference where the recipe puts them, its
    KernelOp in OPS, and kernels/__init__.py run again so that it exports OPS as it does."""
    from tritium import kernels
    from tritium.kernels import ops, reference, validation_ops
    assert NAME not in ops.OPS and not hasattr(kernels, MODULE)
    (tmp_path / f"{MODULE}.py").write_text(KERNEL_MODULE, encoding="utf-8")
    request.addfinalizer(lambda: sys.modules.pop(f"{kernels.__name__}.{MODULE}", None))
    monkeypatch.setattr(validation_ops, "check_scaled_add", check_scaled_add, raising=False)
    monkeypatch.setattr(reference, "scaled_add_ref", scaled_add_ref, raising=False)
    monkeypatch.setitem(ops.OPS, NAME, ops.KernelOp(NAME, MODULE, reference.scaled_add_ref))
    # What running kernels/__init__.py again binds (the op, a longer __all__) and what importing
    # the module binds (its name on the package) go when the test ends.
    for name in (NAME, MODULE):
        monkeypatch.setattr(kernels, name, None, raising=False)
    monkeypatch.setattr(kernels, "__all__", kernels.__all__)
    importlib.reload(kernels)
    monkeypatch.setattr(kernels, "__path__", [*kernels.__path__, str(tmp_path)])
    return kernels


def test_a_kernel_added_as_the_recipe_says(scaled_add_op):
    kernels = scaled_add_op
    from tritium.kernels import reference
    op = kernels.scaled_add
    assert op is kernels.OPS[NAME] and NAME in kernels.__all__
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen)
    launcher = f"{kernels.__name__}.{MODULE}"
    # On CPU tensors the op is the reference, and the kernel's module is not even imported.
    assert torch.equal(op(x, y, 0.5), reference.scaled_add_ref(x, y, 0.5)) and launcher not in sys.modules
    assert torch.equal(ScaledResidual(0.5)(x, y), reference.scaled_add_ref(x, y, 0.5))
    oracle = x.double() + 0.5 * y.double()
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        got = op.triton(x.to(dtype).to(DEVICE), y.to(dtype).to(DEVICE), 0.5)
        assert got.dtype == dtype and torch.allclose(got.double().cpu(), oracle, rtol=tolerance, atol=tolerance)
    assert launcher in sys.modules and kernels.scaled_add is op  # the module did not shadow the op
    if DEVICE == "cuda":  # on CUDA tensors the op is the kernel
        assert torch.equal(op(x.to(DEVICE), y.to(DEVICE), 0.5), op.triton(x.to(DEVICE), y.to(DEVICE), 0.5))
    # Step 4: the wrapper's errors, each naming the op and the argument.
    for bad, message in (((x, y[:, :8]), r"scaled_add: y must have shape x.shape = \(5, 48\), got \(5, 8\)"),
                         ((x.int(), y.int()), r"scaled_add: x must have dtype"),
                         ((x.t(), y.t()), r"scaled_add: x must be contiguous"),
                         ((x, y.double()), r"scaled_add: y must have dtype")):
        with pytest.raises(ValueError, match=message):
            op.triton(bad[0].to(DEVICE), bad[1].to(DEVICE), 0.5)


def test_every_op_keeps_the_recipes_conventions():
    """Each op's reference is `<name>_ref` in kernels/reference.py with the launcher's positional
    parameters (and no keyword the launcher lacks), its module is named apart from it, and
    `kernels.<name>` is the op."""
    from tritium import kernels
    from tritium.kernels import reference
    for name, op in kernels.OPS.items():
        assert op.reference is getattr(reference, f"{name}_ref") and op.module != name, name
        assert getattr(kernels, name) is op and name in kernels.__all__, name
        ours, theirs = inspect.signature(op.triton).parameters, inspect.signature(op.reference).parameters
        assert ([n for n, p in ours.items() if p.kind in POSITIONAL]
                == [n for n, p in theirs.items() if p.kind in POSITIONAL]), name
        assert {n for n, p in theirs.items() if p.kind == p.KEYWORD_ONLY} <= set(ours), name
