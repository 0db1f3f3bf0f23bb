"""fp8_matmul_few_rows (decode batches of FP8 linear layers) against a float64 product of the
dequantized inputs: row counts 1-16, sizes that are not multiples of the tiles, split and
unsplit K, the operands swapped, every output dtype the engine uses; and its argument errors."""

import re

import pytest
import torch
from kernel_checks import DEVICE, ON_GPU, rel_err

from tritium import kernels
from tritium.kernels import reference

FP8 = torch.float8_e4m3fn


def _inputs(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x_q = (torch.randn(m, k, generator=g) * 100).clamp(-448, 448).to(FP8)
    w_q = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8)
    x_scale = torch.rand(m, 1, generator=g) * 1e-2 + 1e-4
    w_scale = torch.rand(1, n, generator=g) * 1e-2 + 1e-4
    return [t.to(DEVICE) for t in (x_q, x_scale, w_q, w_scale)]


def _oracle(x_q, x_scale, w_q, w_scale):
    return (x_q.double() * x_scale.double()) @ (w_q.double() * w_scale.double().t()).t()


# (rows, N, K, split_k or 0 for the automatic choice, block_n, block_k)
CASES = [(1, 40, 200, 0, 32, 64), (3, 96, 256, 2, 32, 64), (16, 64, 384, 3, 64, 128),
         (5, 130, 129, 1, 64, 32), (2, 300, 1024, 0, 64, 128)]
OUT_DTYPES = [torch.float32, torch.float16,
              pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not ON_GPU, reason="interpreter has no bf16"))]


# The weight as the MMA's first operand (swap_ab): columns past N, split K, rows 1-16.
SWAPPED = [(1, 40, 200, 0, 64, 64), (16, 130, 384, 3, 64, 128), (5, 300, 1024, 0, 128, 128)]


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("case, swap", [(c, False) for c in CASES] + [(c, True) for c in SWAPPED])
def test_matches_float64(case, swap, out_dtype):
    from tritium.kernels.fp8_matmul import Fp8MatmulConfig
    m, n, k, split, block_n, block_k = case
    args = _inputs(m, n, k, seed=n)
    out = kernels.fp8_matmul_few_rows.triton(*args, out_dtype, config=Fp8MatmulConfig(
        block_n=block_n, block_k=block_k, split_k=split, num_stages=2, swap_ab=swap))
    assert out.shape == (m, n) and out.dtype == out_dtype
    err = rel_err(out, _oracle(*args))
    assert err < (1e-5 if out_dtype == torch.float32 else 4e-3), err


def test_reference_matches_float64_and_the_kernel_the_reference():
    args = _inputs(7, 50, 96, seed=1)
    ref = reference.fp8_matmul_few_rows_ref(*[a.cpu() for a in args], torch.float32)
    assert rel_err(ref, _oracle(*args)) < 1e-6
    out = kernels.fp8_matmul_few_rows.triton(*args, torch.float32)
    assert rel_err(out, ref) < 1e-6


def test_automatic_split_covers_the_gpu():
    from tritium.kernels.fp8_matmul import Fp8MatmulConfig, choose_split_k
    cfg = Fp8MatmulConfig()  # 64 columns a program, 128 K a step
    assert choose_split_k(28672, 4096, cfg, 132) == 1    # gate_up: 448 programs already
    assert choose_split_k(4096, 14336, cfg, 132) == 5    # down: 64 column blocks x 5
    assert choose_split_k(4096, 4096, cfg, 132) == 5     # o_proj: 64 x 5, 6 steps each
    assert choose_split_k(6144, 1024, cfg, 132) == 2     # short K: at least 4 steps a slice


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(x_q=torch.zeros(17, 64, dtype=FP8, device=DEVICE), x_scale=torch.ones(17, 1, device=DEVICE)),
     "fp8_matmul_few_rows: x_q may have at most 16 rows (torch._scaled_mm serves more), got 17"),
    (lambda a: a.update(weight=torch.zeros(32, 48, dtype=FP8, device=DEVICE)),
     "fp8_matmul_few_rows: weight [N, K] has K = 48 but x_q has K = 64"),
    (lambda a: a.update(x_q=a["x_q"].float()),
     "fp8_matmul_few_rows: x_q must have dtype torch.float8_e4m3fn, got torch.float32"),
    (lambda a: a.update(weight_scale=torch.ones(32, device=DEVICE)),
     "fp8_matmul_few_rows: weight_scale must be 2-D [1, N], got shape (32,)"),
    (lambda a: a.update(out_dtype=torch.int32),
     "fp8_matmul_few_rows: out_dtype must be torch.float16, torch.bfloat16 or torch.float32, got torch.int32"),
])
def test_rejects_bad_arguments(change, message):
    x_q, x_scale, weight, weight_scale = _inputs(2, 32, 64, seed=0)
    args = dict(x_q=x_q, x_scale=x_scale, weight=weight, weight_scale=weight_scale, out_dtype=torch.bfloat16)
    change(args)
    for fn in (kernels.fp8_matmul_few_rows.triton, reference.fp8_matmul_few_rows_ref):
        with pytest.raises(ValueError, match=re.escape(message) + "$"):
            fn(**args)


def test_tuned_table_picks_the_config_per_gpu_and_shape(tmp_path, monkeypatch):
    import json

    from tritium.kernels import fp8_matmul
    from tritium.kernels.fp8_matmul import Fp8MatmulConfig, tuned_config
    table = tmp_path / "fp8_matmul.json"
    here = fp8_matmul.device_name(torch.device(DEVICE))  # "cpu" in the interpreter
    table.write_text(json.dumps({"configs": {
        "GPU A": {"96x256": {"block_n": 32, "block_k": 64, "split_k": 2, "num_warps": 4, "num_stages": 2}},
        here: {"96x256": {"block_n": 32, "block_k": 64, "split_k": 3, "num_warps": 4, "num_stages": 2}}}}))
    assert tuned_config(96, 256, "GPU A", str(table)) == Fp8MatmulConfig(32, 64, 2, 4, 2)
    assert tuned_config(96, 255, "GPU A", str(table)) == Fp8MatmulConfig()  # another shape
    assert tuned_config(96, 256, "GPU B", str(table)) == Fp8MatmulConfig()  # another GPU
    assert tuned_config(96, 256, "GPU A", str(tmp_path / "none.json")) == Fp8MatmulConfig()

    # The kernel call takes the table's config for its device when none is given.
    monkeypatch.setattr(fp8_matmul, "TUNED_CONFIGS", str(table))
    seen = []
    real_split = fp8_matmul.choose_split_k
    monkeypatch.setattr(fp8_matmul, "choose_split_k", lambda *a: seen.append(a[2]) or real_split(*a))
    args = _inputs(3, 96, 256, seed=5)
    out = kernels.fp8_matmul_few_rows.triton(*args, torch.float32)
    assert seen == [Fp8MatmulConfig(32, 64, 3, 4, 2)]
    assert rel_err(out, _oracle(*args)) < 1e-5


def test_shipped_tuned_table_loads():
    from tritium.kernels.fp8_matmul import TUNED_CONFIGS, Fp8MatmulConfig, load_tuned_configs
    h200 = load_tuned_configs(TUNED_CONFIGS)["NVIDIA H200"]
    # Llama-3-8B's qkv, o, gate_up and down were all faster with a tuned tile on the H200.
    assert {"6144x4096", "4096x4096", "28672x4096", "4096x14336"} <= set(h200)
    assert h200["4096x14336"] == Fp8MatmulConfig(block_n=32, block_k=256, num_stages=5)


@pytest.mark.parametrize("entry, message", [
    ({"4096": {}}, "NVIDIA H200 4096: the shape must be N x K, like 4096x14336"),
    ({"64x64": {"block_m": 16}}, "NVIDIA H200 64x64: Fp8MatmulConfig.__init__() got an unexpected keyword argument 'block_m'"),
    ({"64x64": {"block_n": 48}}, "NVIDIA H200 64x64: block_n must be a power of two of at least 16, got 48"),
    ({"64x64": {"num_stages": 0}}, "NVIDIA H200 64x64: num_warps must be 1, 2, 4 or 8, num_stages at least 1 "
                                   "and split_k at least 0, got Fp8MatmulConfig(block_n=64, block_k=128, "
                                   "split_k=0, num_warps=4, num_stages=0, swap_ab=False)"),
])
def test_malformed_tuned_table_is_refused(tmp_path, entry, message):
    import json

    from tritium.kernels.fp8_matmul import load_tuned_configs
    table = tmp_path / "bad.json"
    table.write_text(json.dumps({"configs": {"NVIDIA H200": entry}}))
    with pytest.raises(ValueError, match=re.escape(f"{table}: {message}") + "$"):
        load_tuned_configs(str(table))


def test_unsummed_slices_add_up_to_the_output():
    """reduce=False: the K slices' float32 partial sums (scales applied), which split_k's sum
    turns into exactly the output."""
    from tritium.kernels.fp8_matmul import Fp8MatmulConfig
    from tritium.kernels.split_k import sum_slices
    args = _inputs(3, 96, 384, seed=2)
    cfg = Fp8MatmulConfig(block_n=32, block_k=64, split_k=3, num_stages=2)
    out = kernels.fp8_matmul_few_rows.triton(*args, torch.float16, config=cfg)
    slices = kernels.fp8_matmul_few_rows.triton(*args, torch.float16, reduce=False, config=cfg)
    assert slices.shape == (3, 3, 96) and slices.dtype == torch.float32
    assert torch.equal(sum_slices(slices, torch.float16), out)
