"""Split-K slices handed from a projection to the kernel after it (backend/layers/
split_k_partials.py): a linear method that returns two halves of its output as slices whenever
it may must leave every result unchanged, and exactly the projections whose next kernel adds
slices must be asked (the FP8 engine end to end: tests/engine/test_fp8.py)."""
import torch
import torch.nn.functional as F

from tritium.layers.layernorm import RMSNorm
from tritium.layers.linear import LinearMethod
from tritium.layers.mlp import GatedMLP
from tritium.layers.split_k_partials import SplitKPartials


class Halves(LinearMethod):
    keeps_partials = True

    def __init__(self) -> None:
        self.asked = []

    def apply(self, layer, x, bias, keep_partials=False):
        y = F.linear(x, layer.weight, bias)
        if not keep_partials:
            return y
        self.asked.append(layer)
        return SplitKPartials(torch.stack([y.float() * 0.5, y.float() * 0.5]), y.dtype)


def test_the_mlp_takes_and_gives_slices():
    torch.manual_seed(0)
    method = Halves()
    mlp = GatedMLP(64, 96, bias=False, dtype=torch.float32, linear_method=method)
    for p in mlp.parameters():
        p.data.normal_()
    x = torch.randn(5, 64)
    gate_up = F.linear(x, mlp.gate_up_proj.weight)
    want = F.linear(F.silu(gate_up[:, :96]) * gate_up[:, 96:], mlp.down_proj.weight)
    # The activation adds gate_up's slices; the down projection sums its own unless asked.
    assert torch.equal(mlp(x), want) and method.asked == [mlp.gate_up_proj]
    out = mlp(x, keep_partials=True)
    assert isinstance(out, SplitKPartials) and out.shape == (5, 64) and method.asked[-1] is mlp.down_proj
    norm, residual = RMSNorm(64, 1e-6, torch.float32), torch.randn(5, 64)
    got, got_residual = norm(out, residual)
    want_normed, want_residual = norm(want, residual)
    assert torch.equal(got, want_normed) and torch.equal(got_residual, want_residual)


def test_a_bias_or_an_adapter_keeps_the_sum():
    method = Halves()
    mlp = GatedMLP(64, 96, bias=True, dtype=torch.float32, linear_method=method)
    for p in mlp.parameters():
        p.data.normal_()
    assert not isinstance(mlp(torch.randn(3, 64), keep_partials=True), SplitKPartials) and not method.asked
    mlp = GatedMLP(64, 96, bias=False, dtype=torch.float32, linear_method=method)
    mlp.gate_up_proj.lora = mlp.down_proj.lora = object()  # (what backend/worker/lora.py sets)
    assert mlp.gate_up_proj(torch.randn(3, 64), keep_partials=True).dim() == 2 and not method.asked
