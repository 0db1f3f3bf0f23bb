"""w4a16_fragment_matmul (4-bit words in wgmma's A-fragment order) against a float64 product
built from the integer weights: row counts from one to past a tile, one and two slabs a program,
split K, act-order's gather, groups of 64 and 128; the repack's order, the argument errors, and
the sm_90 build with either widening, paired PTX or triton.language (no shared-memory store in the
K loop, where the shipped layout has four). The paired PTX runs only on a GPU."""

import re

import pytest
import torch
from kernel_checks import BF16_ON_GPU_ONLY, DEVICE, ON_GPU, rel_err

from tritium.kernels.w4a16_fragment import FragmentConfig, fragment_order, repack_fragment, w4a16_fragment_matmul

DTYPES = [torch.float16,
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not ON_GPU, reason=BF16_ON_GPU_ONLY))]


def _case(m, n, k, group, shuffled, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=g)
    zeros = torch.randint(0, 16, (k // group, n), generator=g).to(torch.float16)
    scales = (torch.rand(k // group, n, generator=g) * 2e-2 + 1e-3).to(torch.float16)
    x = torch.randn(m, k, generator=g).to(dtype)
    perm = torch.randperm(k, generator=g).to(torch.int32) if shuffled else None
    gi = torch.arange(k) // group
    w_sorted = ((q.double() - zeros.double()[gi]) * scales.double()[gi]).to(dtype).double()  # row k of q
    w = torch.empty_like(w_sorted)
    w[perm.long() if shuffled else torch.arange(k)] = w_sorted  # multiplies x[:, perm[k]]
    args = [t.to(DEVICE) for t in (x, repack_fragment(q), scales, zeros)]
    return args, (perm.to(DEVICE) if shuffled else None), x.double() @ w


# (rows, N, K, group, shuffled, block_m, slabs, split_k, ksteps)
CASES = [(1, 64, 128, 64, False, 16, 1, 1, 1), (5, 128, 256, 128, True, 16, 2, 2, 1), (16, 192, 128, 64, False, 16, 1, 0, 1),
         (37, 128, 192, 64, True, 32, 2, 1, 1), (70, 64, 256, 128, False, 64, 1, 3, 1),
         (9, 128, 512, 128, True, 16, 1, 2, 2), (20, 256, 256, 128, False, 32, 4, 1, 2),
         # a long K loop: on a GPU, MMAs of one iteration still run while the next widens its words
         (64, 128, 4096, 128, False, 64, 2, 1, 2), (24, 128, 1024, 256, True, 16, 1, 0, 4)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "m{}-n{}-k{}-g{}{}-slabs{}-ksteps{}".format(
    *c[:4], "-perm" if c[4] else "", c[6], c[8]))
def test_matches_float64(case, dtype):
    m, n, k, group, shuffled, bm, slabs, split, ksteps = case
    (x, words, scales, zeros), perm, oracle = _case(m, n, k, group, shuffled, m + n + k, dtype)
    out = w4a16_fragment_matmul(x, words, scales, zeros, group, perm, config=FragmentConfig(
        block_m=bm, slabs=slabs, split_k=split, num_stages=2, ksteps=ksteps))
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, oracle) < (4e-3 if dtype == torch.bfloat16 else 2e-3)


def test_repack_puts_each_threads_fragment_in_its_words():
    q = torch.arange(64 * 64).reshape(64, 64) % 16  # values from their place
    words = repack_fragment(q)
    rows, cols = fragment_order()
    assert words.shape == (1, 1, 128, 4)
    fields = torch.stack([(words[0, 0].long() >> (4 * j)) & 15 for j in range(8)], dim=-1)  # [t, word, field]
    # Value khalf * 4 + rowhalf * 2 + pair of a word is its field pair * 4 + khalf * 2 + rowhalf.
    values = fields[..., [0, 4, 1, 5, 2, 6, 3, 7]].reshape(128, 32)
    assert torch.equal(values, q[cols, rows])
    # Thread 5 of warp 1 (g 1, tid 1): columns 17 and 25 (rows of the MMA), K 2, 3, 10, 11, 18, ...
    assert rows[37, :4].tolist() == [17, 17, 25, 25] and cols[37, :8].tolist() == [2, 3, 2, 3, 10, 11, 10, 11]


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "words": a["words"][:1]}, "words must come from repack_fragment for K = 128"),
    (lambda a: {**a, "group_size": 32}, r"groups of 32 \(a multiple of 64 dividing K = 128\)"),
    (lambda a: {**a, "config": FragmentConfig(slabs=2)}, r"N \(64\) must be a multiple of 128 for 2 slabs"),
    (lambda a: {**a, "config": FragmentConfig(ksteps=2)}, "groups of 64 cannot hold 2 steps of 64 an iteration"),
    (lambda a: {**a, "x": a["x"].float()}, "x must be a 2-D float16 or bfloat16 tensor"),
    (lambda a: {**a, "perm": torch.zeros(64, dtype=torch.int32, device=DEVICE)}, r"perm must be int32 of shape \(128,\)"),
])
def test_argument_errors(change, message):
    (x, words, scales, zeros), _, _ = _case(2, 64, 128, 64, False, 0, torch.float16)
    args = change({"x": x, "words": words, "scales": scales, "zeros": zeros, "group_size": 64, "perm": None,
                   "config": None})
    with pytest.raises(ValueError, match=f"^w4a16_fragment_matmul: {message}"):
        w4a16_fragment_matmul(args["x"], args["words"], args["scales"], args["zeros"], args["group_size"],
                              args["perm"], config=args["config"])
    with pytest.raises(ValueError, match=r"^w4a16_fragment_matmul: K \(96\) and N \(64\) must be multiples of 64$"):
        repack_fragment(torch.zeros(96, 64, dtype=torch.int64))


@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernel runs for real")
@pytest.mark.parametrize("slabs, block_m, widening, ksteps", [(1, 64, "tl", 1), (2, 256, "tl", 2), (1, 16, "paired", 2),
                                                               (2, 128, "paired", 1), (2, 256, "paired", 2)])
def test_the_sm90_loop_keeps_the_tile_out_of_shared_memory(slabs, block_m, widening, ksteps):
    import os
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(__file__), "hopper_compile_w4a16_fragment.py")
    run = subprocess.run([sys.executable, script, str(slabs), str(block_m), widening, str(ksteps)], capture_output=True, text=True,
                         timeout=300, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert run.returncode == 0, run.stderr[-3000:]
    counts = dict(re.findall(r"(\w+)=(\d+)", run.stdout.strip().splitlines()[-1]))
    assert int(counts["wgmma"]) >= 4 * ksteps and counts["wait0"] == "0", run.stdout
    assert counts["st_shared"] == "0" and counts["spills"] == "0", run.stdout


@pytest.mark.parametrize("method", ["mma", "dequant"])
def test_the_linear_op_by_either_method_and_its_reference(method):
    """kernels.w4a16_fragment_linear: the kernel or the weight dequantized once then one GEMM, each
    against float64; the reference (the CPU engine's path) the same."""
    from tritium import kernels
    (x, words, scales, zeros), perm, oracle = _case(6, 128, 256, 128, True, 3, torch.float16)
    out = kernels.w4a16_fragment_linear.triton(x, words, scales, zeros, 128, perm,
                                               config=FragmentConfig(block_m=16, method=method, num_stages=2))
    assert out.shape == (6, 128) and rel_err(out, oracle) < 2e-3
    ref = kernels.w4a16_fragment_linear.reference(x.cpu().float(), words.cpu(), scales.cpu(), zeros.cpu(), 128,
                                                  perm.cpu())
    assert rel_err(ref, oracle) < 2e-3  # (the oracle's weights are rounded to float16, the reference's are not)
    with pytest.raises(ValueError, match=r"^w4a16_fragment_matmul: x must be a 2-D float16 or bfloat16 tensor"):
        kernels.w4a16_fragment_linear.triton(x.float(), words, scales, zeros, 128, perm,
                                             config=FragmentConfig(method=method))


def test_the_table_decides_the_layout_and_each_buckets_method(tmp_path):
    import json

    from tritium.kernels.w4a16_fragment_layout import DEFAULT_CONFIGS, choose_config, uses_fragment_layout
    path = str(tmp_path / "table.json")
    with open(path, "w") as f:
        json.dump({"configs": {"cpu": {"192x128/w4g64/m16": {"method": "dequant"},
                                       "192x128/w4g64/m1": {"block_m": 16, "slabs": 1, "ksteps": 1}}}}, f)
    cpu = torch.device("cpu")
    assert uses_fragment_layout(192, 128, 4, 64, cpu, path)
    assert not uses_fragment_layout(192, 128, 8, 64, cpu, path)  # 4-bit only
    assert not uses_fragment_layout(256, 128, 4, 64, cpu, path)  # a shape the table does not hold
    assert choose_config(9, 192, 128, 64, cpu, path).method == "dequant"
    assert choose_config(1, 192, 128, 64, cpu, path) == FragmentConfig(block_m=16, slabs=1, ksteps=1)
    assert choose_config(300, 192, 128, 64, cpu, path) == DEFAULT_CONFIGS[1024]  # no entry: the default
    assert DEFAULT_CONFIGS[256].slabs == 2 and choose_config(200, 192, 128, 64, cpu, path).slabs == 1  # 192 = 3 slabs
    assert DEFAULT_CONFIGS[64].ksteps == 2 and choose_config(50, 192, 128, 64, cpu, path).ksteps == 1  # groups of 64
    bad = str(tmp_path / "bad.json")  # (tables are read once per path)
    with open(bad, "w") as f:
        json.dump({"configs": {"cpu": {"192x128/w4g64/m1": {"method": "gemv"}}}}, f)
    with pytest.raises(ValueError, match="method 'gemv': expected 'mma' or 'dequant'"):
        uses_fragment_layout(192, 128, 4, 64, cpu, bad)


def test_unsummed_slices_add_up_to_the_output():
    """reduce=False: a split launch's float32 slices, which split_k's sum turns into exactly the
    output; one slice is the output itself."""
    from tritium.kernels.split_k import sum_slices
    (x, words, scales, zeros), perm, _ = _case(5, 128, 512, 128, True, 9, torch.float16)
    cfg = FragmentConfig(block_m=16, split_k=2, num_stages=2)
    out = w4a16_fragment_matmul(x, words, scales, zeros, 128, perm, config=cfg)
    slices = w4a16_fragment_matmul(x, words, scales, zeros, 128, perm, reduce=False, config=cfg)
    assert slices.shape == (2, 5, 128) and slices.dtype == torch.float32
    assert torch.equal(sum_slices(slices, torch.float16), out)
    whole = w4a16_fragment_matmul(x, words, scales, zeros, 128, perm, reduce=False,
                                  config=FragmentConfig(block_m=16, split_k=1, num_stages=2))
    assert whole.shape == (5, 128) and whole.dtype == torch.float16
