"""w4a16_matmul (AWQ / GPTQ linear layers) against a float64 product built from the integer
weights themselves (this file packs them; nothing here unpacks): 4 and 8 bits, group sizes
16-128 and one group over K, shuffled input order (GPTQ desc_act), row counts for the decode
tile and the prefill tiles, split and unsplit K; the reference; and the argument errors."""

import re

import pytest
import torch
from kernel_checks import BF16_ON_GPU_ONLY, DEVICE, ON_GPU, rel_err

from tritium import kernels
from tritium.kernels import reference


def _pack_along_n(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] integers -> [K, N * bits / 32] int32 words, column 8c + j (4 bits) in bits 4j.."""
    per_word = 32 // bits
    k, n = q.shape
    words = torch.zeros(k, n // per_word, dtype=torch.int64)
    for j in range(per_word):
        words |= q[:, j::per_word].long() << (bits * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _case(m, n, k, group, bits, shuffled, seed, dtype):
    """Inputs and the float64 oracle: x @ W^T with W[n, perm[k]] = (q - z) * s rounded to the
    activations' dtype (the kernel's tensor-core operand), summed in float64."""
    g = torch.Generator().manual_seed(seed)
    top = 2**bits
    q = torch.randint(0, top, (k, n), generator=g)
    groups = k // group
    zeros = torch.randint(0, top, (groups, n), generator=g).to(torch.float16)
    scales = (torch.rand(groups, n, generator=g) * 2e-2 + 1e-3).to(torch.float16)
    x = torch.randn(m, k, generator=g).to(dtype)
    perm = torch.randperm(k, generator=g).to(torch.int32) if shuffled else None
    gi = torch.arange(k) // group
    w_sorted = ((q.double() - zeros.double()[gi]) * scales.double()[gi]).to(dtype).double()  # [K, N]
    w = torch.empty_like(w_sorted)
    w[perm.long() if shuffled else torch.arange(k)] = w_sorted
    oracle = x.double() @ w
    args = [t.to(DEVICE) if t is not None else None
            for t in (x, _pack_along_n(q, bits), scales, zeros)]
    return args, (perm.to(DEVICE) if shuffled else None), oracle


# (rows, N, K, group size, bits, shuffled, block_m, block_n, block_k, split_k)
CASES = [(1, 64, 128, 32, 4, False, 16, 32, 32, 0), (3, 96, 256, 64, 4, True, 16, 32, 64, 2),
         (16, 40, 128, 128, 4, False, 16, 32, 64, 1), (5, 64, 96, 96, 4, True, 16, 64, 32, 0),
         (2, 48, 128, 16, 8, True, 16, 16, 16, 3), (37, 72, 64, 32, 4, False, 32, 32, 32, 1),
         (70, 128, 128, 64, 8, False, 64, 64, 64, 2)]
DTYPES = [torch.float16,
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not ON_GPU, reason=BF16_ON_GPU_ONLY))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "m{}-n{}-k{}-g{}-w{}{}".format(
    *c[:5], "-perm" if c[5] else ""))
def test_matches_float64(case, dtype):
    from tritium.kernels.w4a16 import W4A16Config
    m, n, k, group, bits, shuffled, bm, bn, bk, split = case
    (x, qweight, scales, zeros), perm, oracle = _case(m, n, k, group, bits, shuffled, n + k, dtype)
    out = kernels.w4a16_matmul.triton(x, qweight, scales, zeros, group, perm, bits=bits, config=W4A16Config(
        block_m=bm, block_n=bn, block_k=bk, split_k=split, group_m=2, num_stages=2))
    assert out.shape == (m, n) and out.dtype == dtype
    # Rounding the output to bf16 (8 significant bits) alone costs about 2e-3 of the norm.
    assert rel_err(out, oracle) < (4e-3 if dtype == torch.bfloat16 else 2e-3)


# The tensor-core kernel with the weight as the MMA's first operand (out^T = W^T x^T): rows past
# the tile, act-order's gather, K slices, 8-bit fields, 16-row tiles.
SWAPPED_CASES = [CASES[1], CASES[4], (37, 72, 64, 32, 4, False, 32, 64, 32, 1), (70, 128, 128, 64, 8, True, 64, 64, 64, 2),
                 (200, 64, 256, 64, 4, False, 128, 64, 64, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SWAPPED_CASES, ids=lambda c: "m{}-n{}-k{}-g{}-w{}{}".format(
    *c[:5], "-perm" if c[5] else ""))
def test_swapped_operands_match_float64(case, dtype):
    from tritium.kernels.w4a16 import W4A16Config
    m, n, k, group, bits, shuffled, bm, bn, bk, split = case
    (x, qweight, scales, zeros), perm, oracle = _case(m, n, k, group, bits, shuffled, n + k + 1, dtype)
    out = kernels.w4a16_matmul.triton(x, qweight, scales, zeros, group, perm, bits=bits, config=W4A16Config(
        block_m=bm, block_n=bn, block_k=bk, split_k=split, group_m=2, num_stages=2, swap_ab=True))
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, oracle) < (4e-3 if dtype == torch.bfloat16 else 2e-3)


# (rows, N, K, group size, bits, shuffled, block_n, block_k, split_k, num_warps[, prefetch]):
# the one-row-per-program GEMV, with several rows too, column tiles past N, K slices (some ending
# inside a group), one group over a K that is not a power of two, a tile of four words a thread
# (16-byte loads), and tiles loaded two steps ahead.
GEMV_CASES = [(1, 64, 128, 32, 4, False, 32, 32, 0, 4), (1, 96, 256, 64, 4, True, 64, 64, 3, 4),
              (3, 40, 128, 128, 4, False, 32, 128, 1, 4), (1, 48, 128, 16, 8, True, 16, 16, 2, 4),
              (2, 24, 64, 64, 8, False, 16, 32, 0, 4), (1, 64, 256, 128, 4, False, 32, 32, 3, 4),
              (2, 64, 96, 96, 4, True, 64, 32, 2, 4), (1, 1032, 64, 32, 4, False, 1024, 16, 2, 1),
              (1, 64, 256, 64, 4, True, 32, 16, 3, 4, 2), (2, 48, 128, 32, 8, False, 16, 16, 2, 4, 2),
              (1, 64, 512, 64, 4, False, 32, 16, 12, 4)]


# The in-kernel sum of K slices (its arrival counters included) on the cases that exercise it
# most: slices ending inside groups of shuffled rows, 8-bit fields, tiles two steps ahead, more
# slices than the last program loads at once (11: a full block of loads and a masked one). In the
# interpreter the other cases' in-kernel sums run under `make test-long` (each costs seconds
# there); on a GPU every case runs.
FUSED_IN_CI = {1, 3, 8, 10}
GEMV_PARAMS = [pytest.param(case, fused, id="m{}-n{}-k{}-g{}-w{}{}-{}".format(
    *case[:5], "-perm" if case[5] else "", "fused-reduce" if fused else "torch-sum"),
    marks=[pytest.mark.long] if fused and i not in FUSED_IN_CI and not ON_GPU else [])
    for i, case in enumerate(GEMV_CASES) for fused in (False, True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case, fused", GEMV_PARAMS)
def test_gemv_matches_float64(case, dtype, fused):
    from tritium.kernels.w4a16 import W4A16Config
    from tritium.kernels.w4a16_paths import _counters
    m, n, k, group, bits, shuffled, bn, bk, split, warps, *prefetch = case
    (x, qweight, scales, zeros), perm, oracle = _case(m, n, k, group, bits, shuffled, n + k, dtype)
    cfg = W4A16Config(block_m=1, block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=2,
                      method="gemv", fused_reduce=fused, prefetch=prefetch[0] if prefetch else 1)
    poison = torch.full((m, n), float("nan"), dtype=dtype, device=x.device)
    for _ in range(2 if fused else 1):  # a second call finds the arrival counters back at zero
        out = kernels.w4a16_matmul.triton(x, qweight, scales, zeros, group, perm, bits=bits, config=cfg)
        assert out.shape == (m, n) and out.dtype == dtype
        assert rel_err(out, oracle) < (4e-3 if dtype == torch.bfloat16 else 2e-3)
        assert not torch.equal(out, poison)
    assert not _counters(x.device).any()


# (rows, N, K, group size, bits, shuffled, block_m, block_n, block_k, split_k, num_warps): the GEMV
# of several rows a program: row tiles past M, columns past N, act-order rows, 8-bit fields, K
# slices ending inside groups, automatic slices.
GEMV_ROWS_CASES = [(2, 64, 256, 64, 4, False, 2, 64, 16, 2, 1), (5, 96, 256, 128, 4, True, 4, 32, 32, 0, 1),
                   (8, 40, 128, 32, 4, False, 8, 32, 16, 1, 1), (3, 48, 128, 16, 8, True, 4, 16, 16, 2, 1),
                   (16, 64, 192, 64, 4, False, 8, 64, 16, 4, 2)]
GEMV_VARIANTS = [pytest.param(c[:6], dict(block_m=c[6], block_n=c[7], block_k=c[8], split_k=c[9], num_warps=c[10]),
                              id=f"rows{c}") for c in GEMV_ROWS_CASES]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case, tiles", GEMV_VARIANTS)
def test_gemv_variants_match_float64(case, tiles, dtype):
    from tritium.kernels.w4a16 import W4A16Config
    m, n, k, group, bits, shuffled = case
    (x, qweight, scales, zeros), perm, oracle = _case(m, n, k, group, bits, shuffled, n + k + 1, dtype)
    cfg = W4A16Config(**tiles, num_stages=1, method="gemv")
    out = kernels.w4a16_matmul.triton(x, qweight, scales, zeros, group, perm, bits=bits, config=cfg)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, oracle) < (4e-3 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.parametrize("kwargs, message", [
    ({"block_m": 4, "method": "gemv", "prefetch": 2}, "a gemv of 4 rows a program has no fused_reduce or prefetch"),
    ({"block_m": 2, "method": "gemv", "fused_reduce": True}, "a gemv of 2 rows a program has no fused_reduce"),
    ({"prefetch": 3, "method": "gemv"}, "prefetch 3: expected 1 or 2"),
])
def test_gemv_config_errors(kwargs, message):
    from tritium.kernels.w4a16 import W4A16Config
    with pytest.raises(ValueError, match=re.escape(message)):
        W4A16Config(**kwargs)


@pytest.mark.parametrize("scale", [2.0**12, 2.0**-12])
def test_gemv_keeps_large_and_tiny_activations(scale):
    """The GEMV multiplies the fields, read as denormal floats, by x * 2^64: its products stay
    normal floats for fp16 activations near the top of their range and for subnormal ones."""
    from tritium.kernels.w4a16 import W4A16Config
    (x, qweight, scales, zeros), perm, _ = _case(1, 64, 256, 64, 4, True, 5, torch.float16)
    x = (x.double() * scale).to(torch.float16)
    assert x.abs().max() > 2000 if scale > 1 else ((x != 0) & (x.abs() < 2**-14)).sum() > 20
    want = reference.w4a16_matmul_ref(x.double().cpu(), qweight.cpu(), scales.cpu(), zeros.cpu(), 64,
                                      None if perm is None else perm.cpu())
    out = kernels.w4a16_matmul.triton(x, qweight, scales, zeros, 64, perm, config=W4A16Config(
        block_m=1, block_n=32, block_k=32, split_k=2, method="gemv"))
    assert rel_err(out, want) < 2e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(5, 296, 128, 32, 4, False), (20, 64, 256, 64, 4, True),
                                  (3, 40, 64, 16, 8, True)], ids=str)
def test_dequantize_then_gemm_matches_float64(case, dtype):
    from tritium.kernels.w4a16 import W4A16Config
    from tritium.kernels.w4a16_paths import w4a16_dequantize
    m, n, k, group, bits, shuffled = case
    (x, qweight, scales, zeros), perm, oracle = _case(m, n, k, group, bits, shuffled, n + k, dtype)
    out = kernels.w4a16_matmul.triton(x, qweight, scales, zeros, group, perm, bits=bits,
                               config=W4A16Config(block_k=32, method="dequant"))
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, oracle) < (4e-3 if dtype == torch.bfloat16 else 2e-3)
    # The dequantized weight itself: each entry (q - z) * s rounded once, rows in qweight's order.
    w = w4a16_dequantize(qweight, scales, zeros, group, bits, dtype, 16)
    want = reference.w4a16_dequantize_ref(qweight.cpu(), scales.cpu(), zeros.cpu(), group, None, bits=bits,
                                          dtype=torch.float64).to(dtype)
    assert torch.equal(w.cpu(), want.t().contiguous())


def test_config_method_is_checked():
    from tritium.kernels.w4a16 import W4A16Config
    with pytest.raises(ValueError, match="^method 'cuda': expected one of gemv, mma, dequant$"):
        W4A16Config(method="cuda")
    with pytest.raises(ValueError, match="^prefetch 3: expected 1 or 2$"):
        W4A16Config(method="gemv", prefetch=3)
    with pytest.raises(ValueError, match="^swap_ab is a choice of the mma method, not of 'dequant'$"):
        W4A16Config(method="dequant", swap_ab=True)
    (x, qweight, scales, zeros), _, _ = _case(1, 64, 128, 32, 4, False, 0, torch.float16)
    with pytest.raises(ValueError, match=r"^w4a16_matmul: a gemv config's block_n \(12\) must be a multiple of 8$"):
        kernels.w4a16_matmul.triton(x, qweight, scales, zeros, 32, config=W4A16Config(block_n=12, method="gemv"))


def test_row_buckets_give_a_short_prefill_its_own_config():
    from tritium.kernels.w4a16 import config_key, row_bucket
    assert [row_bucket(m) for m in (1, 2, 9, 17, 65, 256, 257, 1024, 1025)] == [1, 8, 16, 64, 256, 256, 1024, 1024, 0]
    assert config_key(4096, 4096, 4, 128, row_bucket(512)) == "4096x4096/w4g128/m1024"


def test_default_configs_at_decode_and_prefill_rows():
    for m in (1, 2, 20, 100, 300):
        (x, qweight, scales, zeros), perm, oracle = _case(m, 64, 256, 128, 4, True, m, torch.float16)
        out = kernels.w4a16_matmul.triton(x, qweight, scales, zeros, 128, perm)
        assert rel_err(out, oracle) < 2e-3, m


@pytest.mark.parametrize("shuffled", [False, True])
def test_reference_matches_float64(shuffled):
    (x, qweight, scales, zeros), perm, oracle = _case(6, 48, 128, 32, 4, shuffled, 7, torch.float64)
    ref = reference.w4a16_matmul_ref(x.cpu(), qweight.cpu(), scales.cpu(), zeros.cpu(), 32,
                                     None if perm is None else perm.cpu())
    assert ref.dtype == torch.float64 and rel_err(ref, oracle) < 1e-12


def test_automatic_split_fills_the_gpu_and_walks_four_steps():
    from tritium.kernels.w4a16 import DEFAULT_CONFIGS, block_k_for, choose_split_k
    cfg = DEFAULT_CONFIGS[16]
    bk = block_k_for(cfg, 128)
    assert choose_split_k(1, 6144, 4096, cfg, bk, 132) == 3     # 96 column tiles -> 288 programs
    assert choose_split_k(1, 28672, 4096, cfg, bk, 132) == 1    # 448 column tiles
    assert choose_split_k(1, 4096, 14336, cfg, bk, 132) == 5
    assert choose_split_k(1, 64, 512, cfg, bk, 132) == 1        # four 128-steps at most
    assert block_k_for(cfg, 32) == 32 and block_k_for(cfg, 96) == 32


def test_gemv_split_aims_at_eight_warps_per_sm_and_two_steps():
    from tritium.kernels.w4a16 import DEFAULT_CONFIGS, block_k_for
    from tritium.kernels.w4a16_paths import gemv_split_k
    cfg = DEFAULT_CONFIGS[1]
    bk = block_k_for(cfg, 128)
    assert cfg.method == "gemv" and bk == 16 and cfg.num_warps == 1
    assert gemv_split_k(1, 6144, 4096, cfg, bk, 132, 8) == 88    # 12 column tiles of one warp
    assert gemv_split_k(1, 28672, 4096, cfg, bk, 132, 8) == 19   # 56 column tiles
    assert gemv_split_k(1, 4096, 14336, cfg, bk, 132, 8) == 132
    assert gemv_split_k(1, 64, 128, cfg, bk, 132, 8) == 4        # two 16-row steps at least


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(bits=3), "bits must be 4 or 8, got 3"),
    (lambda a: a.update(x=a["x"].float()),
     "x must have dtype torch.float16 or torch.bfloat16, got torch.float32"),
    (lambda a: a.update(qweight=a["qweight"][:64]),
     "qweight [K, N * bits / 32] has K = 64 but x has K = 128"),
    (lambda a: a.update(group_size=48), "group_size must be a power of two of at least 16, or K, got 48"),
    (lambda a: a.update(scales=a["scales"][:, :8]),
     "scales must have shape [K / group_size, N] = (4, 64), got (4, 8)"),
    (lambda a: a.update(perm=torch.arange(128, device=DEVICE)),
     "perm must have dtype torch.int32, got torch.int64"),
])
def test_argument_errors(change, message):
    (x, qweight, scales, zeros), _, _ = _case(2, 64, 128, 32, 4, False, 0, torch.float16)
    args = dict(x=x, qweight=qweight, scales=scales, zeros=zeros, group_size=32, perm=None, bits=4)
    change(args)
    with pytest.raises(ValueError, match="^" + re.escape("w4a16_matmul: " + message) + "$"):
        kernels.w4a16_matmul.triton(**args)


@pytest.mark.parametrize("tiles", [dict(block_m=1, block_n=32, block_k=32, split_k=3, method="gemv"),
                                   dict(block_m=2, block_n=64, block_k=16, split_k=2, method="gemv"),
                                   dict(block_m=16, block_n=32, block_k=32, split_k=2)],
                         ids=["gemv", "gemv-rows", "mma"])
def test_unsummed_slices_add_up_to_the_output(tiles):
    """reduce=False (for a norm that adds the slices itself): a launch that splits K returns its
    float32 slices, which split_k's sum turns into exactly the output; one slice is the output."""
    from tritium.kernels.split_k import sum_slices
    from tritium.kernels.w4a16 import W4A16Config
    (x, qweight, scales, zeros), perm, _ = _case(2, 64, 256, 64, 4, True, 5, torch.float16)
    cfg = W4A16Config(num_stages=1, **tiles)
    out = kernels.w4a16_matmul.triton(x, qweight, scales, zeros, 64, perm, config=cfg)
    slices = kernels.w4a16_matmul.triton(x, qweight, scales, zeros, 64, perm, reduce=False, config=cfg)
    assert slices.shape == (tiles["split_k"], 2, 64) and slices.dtype == torch.float32
    assert torch.equal(sum_slices(slices, torch.float16), out)
    whole = kernels.w4a16_matmul.triton(x, qweight, scales, zeros, 64, perm, reduce=False,
                                        config=W4A16Config(num_stages=1, **{**tiles, "split_k": 1}))
    assert whole.shape == (2, 64) and whole.dtype == torch.float16
