"""fused_moe (mixture-of-experts MLP) against a float64 product computed pair by pair with gathered
expert weights (no sorting, no per-expert loop: independent of kernels/moe.py and of the
reference), with the kernel's rounding points (gate, up, silu and their product in the dtype).
Experts without a token hold NaN weights, so a kernel that touches them fails. Also: the
alignment step's exact outputs on a hand-made case, FP8 weights with per-channel and block
scales, the reference, the default configs, and the argument errors."""

import re

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import BF16_ON_GPU_ONLY, DEVICE, ON_GPU, rel_err

from tritium import kernels
from tritium.kernels import reference

FP8 = torch.float8_e4m3fn


def _oracle(x, w13, w2, weights, ids, dtype):
    """float64 sum over each token's k of weight * w2[e] @ (silu(gate) * up), intermediate values
    rounded to `dtype` where the kernel rounds them; w13 / w2 already dequantized (float64)."""
    def r(t):
        return t.to(dtype).double()
    ids = ids.long().cpu()
    inter = w13.shape[1] // 2
    gate_up = torch.einsum("mh,mkoh->mko", x.double().cpu(), w13[ids])  # [M, top_k, 2I]
    h = r(r(F.silu(r(gate_up[..., :inter]))) * r(gate_up[..., inter:]))
    down = torch.einsum("mki,mkoi->mko", h, w2[ids])                   # [M, top_k, H]
    return (down * weights.double().cpu()[..., None]).sum(1)


def _routing(m, e, top_k, gen, used=None):
    """Distinct experts per token drawn from `used` (default: all), and softmax-like weights."""
    pool = torch.tensor(used if used is not None else range(e))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:top_k]] for _ in range(m)]) \
        if m else torch.zeros(0, top_k, dtype=torch.long)
    weights = torch.rand(m, top_k, generator=gen) + 0.1
    return ids.to(torch.int32), weights / weights.sum(1, keepdim=True)


def _case(m, e, top_k, hidden, inter, dtype, seed, used=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(e, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    ids, weights = _routing(m, e, top_k, g, used)
    oracle = _oracle(x, w13.double(), w2.double(), weights, ids, dtype)
    unused = sorted(set(range(e)) - set(ids.flatten().tolist()))
    w13[unused], w2[unused] = float("nan"), float("nan")  # never read
    return [t.to(DEVICE) for t in (x, w13, w2, weights, ids)], oracle, unused


# (M, E, top_k, H, I, experts used or None, config (block_m, block_n, block_k, group_m) or None)
CASES = [
    (1, 4, 1, 64, 32, None, (16, 32, 64, 1)),
    (7, 8, 2, 80, 48, [1, 2, 5, 6], (16, 32, 32, 1)),      # 4 experts without tokens; H, I past tiles
    (64, 16, 8, 32, 32, list(range(1, 16)), (16, 32, 32, 2)),  # top-k 8, expert 0 idle
    (64, 4, 2, 64, 64, None, (32, 64, 64, 4)),
    (2, 16, 8, 48, 32, None, None),                          # defaults; most experts idle
]
LONG_CASES = [(512, 16, 2, 128, 96, None, None), (300, 8, 4, 64, 64, [0, 1, 2, 3, 4, 5, 6], (64, 64, 32, 8))]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _bound(dtype):
    # The output rounded to fp16 / bf16 (11 / 8 significant bits) costs ~3e-4 / 2e-3 of the norm.
    return {torch.float32: 1e-5, torch.float16: 1.5e-3, torch.bfloat16: 1e-2}[dtype]


def _params(cases, long=False):
    bf16 = pytest.mark.skipif(not ON_GPU, reason=BF16_ON_GPU_ONLY)
    return [pytest.param(c, dtype, id="m{}-e{}-top{}-h{}-i{}".format(*c[:5]) + f"-{str(dtype)[6:]}",
                         marks=([pytest.mark.long] if long else []) + ([bf16] if dtype == torch.bfloat16 else []))
            for c in cases for dtype in DTYPES]


@pytest.mark.parametrize("case, dtype", _params(CASES) + _params(LONG_CASES, long=True))
def test_matches_float64(case, dtype):
    from tritium.kernels.moe import FusedMoEConfig
    m, e, top_k, hidden, inter, used, tiles = case
    (x, w13, w2, weights, ids), oracle, unused = _case(m, e, top_k, hidden, inter, dtype, m + e + top_k, used)
    assert used is None or unused  # the cases with idle experts have some
    config = FusedMoEConfig(*tiles, num_warps=4, num_stages=2) if tiles else None
    out = kernels.fused_moe.triton(x, w13, w2, weights, ids, config=config)
    assert out.shape == (m, hidden) and out.dtype == dtype
    assert rel_err(out, oracle) < _bound(dtype)


def _fp8_case(block: bool, seed: int):
    """fp16 activations, FP8 weights with per-channel [E, N] or 128 x 128 block scales; the oracle
    dequantizes (widen, times the scale of the weight's channel / block)."""
    g = torch.Generator().manual_seed(seed)
    m, e, top_k, hidden, inter = 9, 4, 2, 160, 96  # blocks past H and past I
    x = torch.randn(m, hidden, generator=g).to(torch.float16)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=g) * 8).to(FP8)
    w2 = (torch.randn(e, hidden, inter, generator=g) * 8).to(FP8)

    def scales(n, k):
        shape = (e, -(-n // 128), -(-k // 128)) if block else (e, n)
        return torch.rand(*shape, generator=g) / (8 * k ** 0.5) + 1e-3

    s13, s2 = scales(2 * inter, hidden), scales(hidden, inter)

    def dequant(w, s):
        if block:
            s = s.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :w.shape[1], :w.shape[2]]
            return w.double() * s.double()
        return w.double() * s.double()[:, :, None]

    ids, weights = _routing(m, e, top_k, g)
    oracle = _oracle(x, dequant(w13, s13), dequant(w2, s2), weights, ids, torch.float16)
    return [t.to(DEVICE) for t in (x, w13, w2, weights, ids, s13, s2)], oracle


@pytest.mark.parametrize("block", [False, True], ids=["per-channel", "block-128"])
def test_fp8_weights_match_float64(block):
    from tritium.kernels.moe import FusedMoEConfig
    (x, w13, w2, weights, ids, s13, s2), oracle = _fp8_case(block, 3 + block)
    out = kernels.fused_moe.triton(x, w13, w2, weights, ids, s13, s2, config=FusedMoEConfig(16, 64, 64, 1, 4, 2))
    assert rel_err(out, oracle) < 1.5e-3
    ref = reference.fused_moe_ref(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu(), s13.cpu(), s2.cpu())
    assert rel_err(ref, oracle) < 1.5e-3


def test_block_scales_take_128_deep_k_steps_whatever_the_tuned_table_says(monkeypatch):
    """The tuned table is keyed by weight dtype, not scale kind: an entry with 256-deep K steps
    serves block-scaled weights with 128-deep ones (an explicit config is refused instead)."""
    from tritium.kernels import moe
    from tritium.kernels.moe import FusedMoEConfig
    (x, w13, w2, weights, ids, s13, s2), oracle = _fp8_case(True, 5)
    monkeypatch.setattr(moe, "choose_config", lambda *a, **k: FusedMoEConfig(16, 64, 256, 1, 4, 2))
    assert rel_err(kernels.fused_moe.triton(x, w13, w2, weights, ids, s13, s2), oracle) < 1.5e-3
    with pytest.raises(ValueError, match=r"^fused_moe: block-wise FP8 scales need a block_k that divides 128, got 256$"):
        kernels.fused_moe.triton(x, w13, w2, weights, ids, s13, s2, config=FusedMoEConfig(16, 64, 256, 1, 4, 2))


def test_alignment_on_a_hand_made_case():
    """Pairs (m, k) -> flat m * 2 + k: token 0 -> experts 2, 0; token 1 -> 2, 3; token 2 -> 0, 2.
    Expert 0: pairs 1, 4; expert 1: none; expert 2: 0, 2, 5; expert 3: 3; expert 4: none."""
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], dtype=torch.int64, device=DEVICE)
    sorted_ids, expert_ids, post = kernels.moe_align_block_size(ids, 5, 4)
    pad = 6
    # At most min(6 pairs, 5 experts) * 3 padding rows: 6 + 15 = 21 -> 24 (whole tiles).
    assert sorted_ids.tolist() == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad] + [pad] * 12
    assert expert_ids.tolist() == [0, 2, 3, -1, -1, -1]  # idle experts 1 and 4 get no tile
    assert post.tolist() == [12]
    assert sorted_ids.dtype == expert_ids.dtype == post.dtype == torch.int32
    sorted_ids, expert_ids, post = kernels.moe_align_block_size(ids.int(), 5, 16)
    assert sorted_ids.tolist() == [1, 4] + [pad] * 14 + [0, 2, 5] + [pad] * 13 + [3] + [pad] * 15 + [pad] * 48
    assert expert_ids.tolist() == [0, 2, 3, -1, -1, -1] and post.tolist() == [48]
    empty = kernels.moe_align_block_size(torch.zeros(0, 2, dtype=torch.int32), 5, 16)
    assert [t.tolist() for t in empty] == [[], [], [0]]


@pytest.mark.parametrize("m,top_k,experts,block_m", [(1, 8, 128, 16), (37, 8, 128, 16), (64, 2, 8, 64),
                                                     (200, 4, 60, 32), (5, 1, 1, 16)])
def test_alignment_kernel_equals_the_torch_ops(m, top_k, experts, block_m):
    """The one-program kernel (small batches) and the PyTorch ops (large ones) give the same three
    tensors, experts without a pair included."""
    gen = torch.Generator().manual_seed(m)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(m)]).int().to(DEVICE)
    torch_ops = kernels.moe_align_block_size(ids, experts, block_m, use_kernel=False)
    kernel = kernels.moe_align_block_size(ids, experts, block_m, use_kernel=True)
    for a, b in zip(torch_ops, kernel):
        assert torch.equal(a, b)


def test_reference_matches_float64():
    (x, w13, w2, weights, ids), oracle, _ = _case(7, 8, 2, 80, 48, torch.float32, 1, [1, 2, 5, 6])
    ref = reference.fused_moe_ref(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    assert rel_err(ref, oracle) < 1e-5
    with pytest.raises(ValueError, match=re.escape("fused_moe: topk_ids must lie in [0, 8), got values from 1 to 8")):
        reference.fused_moe_ref(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu().clamp(max=8) + 2 * (ids.cpu() == 6))


def test_default_configs_by_rows_per_expert():
    from tritium.kernels.moe import DEFAULT_CONFIGS, default_config, row_bucket
    assert [row_bucket(r) for r in (1, 2, 4, 5, 16, 17, 64, 65, 256, 257)] == [1, 4, 4, 16, 16, 64, 64, 256, 256, 0]
    assert default_config(1, 8, 64, torch.bfloat16) == DEFAULT_CONFIGS[1]       # decode
    assert default_config(64, 8, 16, torch.bfloat16) == DEFAULT_CONFIGS[64]     # 32 rows an expert
    assert default_config(256, 2, 4, torch.bfloat16) == DEFAULT_CONFIGS[256]
    assert default_config(8192, 8, 64, torch.bfloat16) == DEFAULT_CONFIGS[0]    # prefill
    f32 = default_config(8192, 8, 64, torch.float32)
    assert f32.block_k == 32 and f32.block_n <= 64
    with pytest.raises(ValueError, match="^block_m must be a power of two of at least 16, got 24$"):
        from tritium.kernels.moe import FusedMoEConfig
        FusedMoEConfig(block_m=24)


def test_tuned_table_picks_the_config_per_gpu_shape_and_bucket(tmp_path, monkeypatch):
    import json

    from tritium.kernels import moe
    from tritium.kernels.moe import FusedMoEConfig, choose_config, config_key, default_config
    tuned = {"block_m": 32, "block_n": 32, "block_k": 32, "group_m": 2, "num_warps": 2, "num_stages": 2}
    here = moe.device_name(torch.device(DEVICE))  # "cpu" in the interpreter
    assert config_key(128, 8, 2048, 768, torch.bfloat16, 0) == "e128-top8-h2048-i768/bfloat16/mbig"
    table = tmp_path / "fused_moe.json"
    table.write_text(json.dumps({"configs": {
        "GPU A": {"e128-top8-h2048-i768/bfloat16/m1": tuned},
        here: {config_key(4, 2, 32, 16, torch.float32, 4): tuned}}}))
    bf16, path = torch.bfloat16, str(table)
    qwen = (8, 128, 2048, 768)  # top_k, E, H, I

    def pick(m, *, shape=qwen, weight_dtype=bf16, gpu="GPU A", path=path):
        return choose_config(m, shape[0], shape[1], shape[2], shape[3], weight_dtype, bf16, gpu, path)

    assert pick(16) == FusedMoEConfig(32, 32, 32, 2, 2, 2)  # 16 tokens x top-8 over 128 experts: 1 row each
    assert pick(17) == default_config(17, 8, 128, bf16)     # 2 rows an expert: another bucket
    assert pick(16, gpu="GPU B") == default_config(16, 8, 128, bf16)
    assert pick(16, shape=(8, 128, 2048, 1536)) == default_config(16, 8, 128, bf16)
    assert pick(16, weight_dtype=torch.float8_e4m3fn) == default_config(16, 8, 128, bf16)
    assert pick(16, path=str(tmp_path / "none.json")) == default_config(16, 8, 128, bf16)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"configs": {"GPU A": {"e1-top1-h16-i16/bfloat16/m1": {**tuned, "block_m": 24}}}}))
    with pytest.raises(ValueError, match="^" + re.escape(f"{bad}: GPU A e1-top1-h16-i16/bfloat16/m1: block_m must be "
                                                         "a power of two of at least 16, got 24") + "$"):
        moe.load_tuned_configs(str(bad))

    # The kernel call takes the table's config for its device when none is given (3 tokens x top-2
    # over 4 experts: 2 rows an expert), and its block_m reaches the alignment step.
    monkeypatch.setattr(moe, "TUNED_CONFIGS", path)
    seen = []
    real_align = moe.moe_align_block_size
    monkeypatch.setattr(moe, "moe_align_block_size",
                        lambda ids, e, block_m: seen.append(block_m) or real_align(ids, e, block_m))
    (x, w13, w2, weights, ids), oracle, _ = _case(3, 4, 2, 32, 16, torch.float32, 5)
    out = kernels.fused_moe.triton(x, w13, w2, weights, ids)
    assert seen == [32]
    assert rel_err(out, oracle) < _bound(torch.float32)


def test_shipped_tuned_table_loads():
    from tritium.kernels.moe import ROW_BUCKETS, TUNED_CONFIGS, config_key, load_tuned_configs
    h100 = load_tuned_configs(TUNED_CONFIGS)["NVIDIA H100 80GB HBM3"]
    # Every bucket of Qwen3-30B-A3B's and Mixtral-8x7B's layers in bf16 (the 2026-12-07 sweep).
    assert set(h100) == {config_key(e, k, h, i, torch.bfloat16, b)
                         for e, k, h, i in ((128, 8, 2048, 768), (8, 2, 4096, 14336)) for b in (*ROW_BUCKETS, 0)}


def _args(**change):
    e, h, i, m, k = 4, 32, 16, 3, 2
    args = dict(x=torch.zeros(m, h), w13=torch.zeros(e, 2 * i, h), w2=torch.zeros(e, h, i),
                topk_weights=torch.zeros(m, k), topk_ids=torch.zeros(m, k, dtype=torch.int32),
                w13_scale=None, w2_scale=None)
    args.update(change)
    return args


ERRORS = [
    (dict(x=torch.zeros(3, 32, dtype=torch.int32)),
     "x must have dtype torch.float16, torch.bfloat16 or torch.float32, got torch.int32"),
    (dict(x=torch.zeros(3, 64)[:, ::2]), "x must be contiguous in its last dimension, got strides (64, 2)"),
    (dict(w13=torch.zeros(4, 31, 32)),
     "w13 must stack gate and up rows, [E, 2*I, H] with an even second dimension, got shape (4, 31, 32)"),
    (dict(w13=torch.zeros(4, 32, 16)), "w13 must have shape [E, 2*I, H] = (4, 32, 32), got (4, 32, 16)"),
    (dict(w2=torch.zeros(3, 32, 16)), "w2 must have shape [E, H, I] = (4, 32, 16), got (3, 32, 16)"),
    (dict(w2=torch.zeros(4, 32, 16, dtype=torch.float16)),
     "w2 must have dtype torch.float32 or torch.float8_e4m3fn, got torch.float16"),
    (dict(w13=torch.zeros(4, 32, 32, dtype=FP8)), "w2 must have the dtype of w13 (torch.float8_e4m3fn), got torch.float32"),
    (dict(topk_ids=torch.zeros(3, 2)), "topk_ids must have dtype torch.int32 or torch.int64, got torch.float32"),
    (dict(topk_ids=torch.zeros(2, 2, dtype=torch.int64)),
     "topk_ids must have shape [M, top_k] with M = 3 and top_k >= 1, got (2, 2)"),
    (dict(topk_weights=torch.zeros(3, 2, dtype=torch.float16)),
     "topk_weights must have dtype torch.float32, got torch.float16"),
    (dict(topk_weights=torch.zeros(3, 1)), "topk_weights must have shape topk_ids.shape = (3, 2), got (3, 1)"),
    (dict(topk_ids=torch.zeros(2, 3, dtype=torch.int32).t()),
     "topk_ids must be contiguous, got strides (1, 3) for shape (3, 2)"),
    (dict(w13_scale=torch.ones(4, 32)),
     "w13_scale is only for torch.float8_e4m3fn weights, got one with torch.float32 weights"),
    (dict(w13=torch.zeros(4, 32, 32, dtype=FP8), w2=torch.zeros(4, 32, 16, dtype=FP8)),
     "w13_scale is required with torch.float8_e4m3fn weights, got None"),
    (dict(w13=torch.zeros(4, 32, 32, dtype=FP8), w2=torch.zeros(4, 32, 16, dtype=FP8),
          w13_scale=torch.ones(4, 32), w2_scale=torch.ones(4, 16)),
     "w2_scale must be float32 [E, N] = (4, 32) (per channel) or [E, N/128, K/128] = (4, 1, 1) "
     "(128 x 128 blocks), got torch.float32 (4, 16)"),
]


@pytest.mark.parametrize("change, message", ERRORS, ids=lambda v: str(v)[:40] if isinstance(v, str) else None)
def test_argument_errors(change, message):
    with pytest.raises(ValueError, match="^" + re.escape("fused_moe: " + message) + "$"):
        kernels.fused_moe.triton(**_args(**change))
    if "float64" not in message and not message.startswith("x must have dtype"):  # the reference takes float64
        with pytest.raises(ValueError, match="^" + re.escape("fused_moe: " + message) + "$"):
            reference.fused_moe_ref(**_args(**change))


def test_alignment_argument_errors():
    with pytest.raises(ValueError, match=r"^moe_align_block_size: block_m must be a power of two, got 24$"):
        kernels.moe_align_block_size(torch.zeros(2, 2, dtype=torch.int32), 4, 24)
    with pytest.raises(ValueError, match=r"^moe_align_block_size: num_experts must be a positive int, got 0$"):
        kernels.moe_align_block_size(torch.zeros(2, 2, dtype=torch.int32), 0, 16)
