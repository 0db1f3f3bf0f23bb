"""rms_norm (with and without the fused residual add), apply_rotary_emb and silu_and_mul against
float64, and their references against the Hugging Face formulas they must reproduce."""

import re

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DEVICE, DTYPES, assert_accurate, poisoned, rel_err

from tritium import kernels
from tritium.kernels import reference


def _randn(*shape, dtype, gen):
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _rms_at_dtype(x, weight, eps):
    """RMSNorm with every operation in x.dtype: what PyTorch does without upcasting."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 200])
def test_rms_norm_matches_float64(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x, res = _randn(6, hidden, dtype=dtype, gen=gen), _randn(6, hidden, dtype=dtype, gen=gen)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    out = kernels.rms_norm.triton(x, weight, 1e-5)
    assert_accurate(out, reference.rms_norm_ref(x.double(), weight.double(), 1e-5),
                    _rms_at_dtype(x.cpu(), weight.cpu(), 1e-5))
    out, new_res = kernels.rms_norm.triton(x, weight, 1e-5, res)
    summed = x.double() + res.double()
    assert_accurate(out, reference.rms_norm_ref(summed, weight.double(), 1e-5),
                    _rms_at_dtype((x + res).cpu(), weight.cpu(), 1e-5))
    assert torch.equal(new_res, x + res)  # the residual stream is rounded to dtype, as in HF


def test_rms_norm_reference_is_hugging_face_llama():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, generator=gen)
    weight = torch.randn(32, generator=gen)
    h = x.to(torch.float32)
    expected = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    assert torch.equal(reference.rms_norm_ref(x, weight, 1e-6), expected)


def _rotary_case(dtype, gen, head_size=64, rotary_dim=64, num_heads=4, num_kv_heads=2, tokens=5):
    query = _randn(tokens, num_heads * head_size, dtype=dtype, gen=gen)
    key = _randn(tokens, num_kv_heads * head_size, dtype=dtype, gen=gen)
    positions = torch.tensor([0, 7, 3, 40, 1][:tokens], dtype=torch.int64).to(DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.outer(torch.arange(50, dtype=torch.float32), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)
    return query, key, positions, cache


def _rotary_at_dtype(x, positions, cache, head_size, rotary_dim):
    """HF Llama's apply_rotary_pos_emb, every operation in x.dtype (cos/sin rounded to it)."""
    x = x.view(x.shape[0], -1, head_size).clone()
    cos, sin = cache[positions].to(x.dtype).chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]
    rot = x[..., :rotary_dim]
    x1, x2 = rot[..., :rotary_dim // 2], rot[..., rotary_dim // 2:]
    x[..., :rotary_dim] = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return x.flatten(1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size, rotary_dim, three_d", [(64, 64, False), (128, 128, True), (64, 32, True)])
def test_rotary_matches_float64(dtype, head_size, rotary_dim, three_d):
    gen = torch.Generator().manual_seed(head_size + rotary_dim)
    query, key, positions, cache = _rotary_case(dtype, gen, head_size, rotary_dim, num_heads=7)
    q64, k64 = query.double().cpu(), key.double().cpu()
    reference.apply_rotary_emb_ref(q64, k64, positions.cpu(), cache.cpu(), head_size=head_size)
    q_dt = _rotary_at_dtype(query.cpu(), positions.cpu(), cache.cpu(), head_size, rotary_dim)
    k_dt = _rotary_at_dtype(key.cpu(), positions.cpu(), cache.cpu(), head_size, rotary_dim)
    if three_d:
        kernels.apply_rotary_emb.triton(query.view(5, -1, head_size), key.view(5, -1, head_size), positions, cache)
    else:
        kernels.apply_rotary_emb.triton(query, key, positions, cache, head_size=head_size)
    assert_accurate(query, q64, q_dt)
    assert_accurate(key, k64, k_dt)


def test_rotary_on_strided_views_of_fused_qkv():
    """The backend rotates q and k in place inside the qkv projection output."""
    gen = torch.Generator().manual_seed(1)
    _, _, positions, cache = _rotary_case(torch.float32, gen)
    qkv = _randn(5, (4 + 2 + 2) * 64, dtype=torch.float32, gen=gen)
    before = qkv.clone()
    q, k = qkv[:, :256], qkv[:, 256:384]
    kernels.apply_rotary_emb.triton(q, k, positions, cache)
    q_ref, k_ref = before[:, :256].clone().cpu(), before[:, 256:384].clone().cpu()
    reference.apply_rotary_emb_ref(q_ref, k_ref, positions.cpu(), cache.cpu())
    assert rel_err(q, q_ref) < 1e-6 and rel_err(k, k_ref) < 1e-6
    assert torch.equal(qkv[:, 384:], before[:, 384:])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_with_head_norms_equals_norm_then_rotary(dtype):
    """Qwen3: each query and key head RMS-normalised with its weight, then rotated, in one pass on
    the strided q and k views of a fused qkv output; the same values as rms_norm over the heads
    followed by apply_rotary_emb (within one rounding of the dtype), v untouched, and accurate
    against float64."""
    gen = torch.Generator().manual_seed(3)
    _, _, positions, cache = _rotary_case(dtype, gen, head_size=64, rotary_dim=64)
    qkv = _randn(5, (7 + 2 + 2) * 64, dtype=dtype, gen=gen) * 3
    q_w = (1 + 0.2 * torch.randn(64, generator=gen)).to(dtype).to(DEVICE)
    k_w = (1 + 0.2 * torch.randn(64, generator=gen)).to(dtype).to(DEVICE)
    before = qkv.clone()
    fused = qkv.clone()
    kernels.apply_rotary_emb.triton(fused[:, :448], fused[:, 448:576], positions, cache, 64, q_w, k_w, 1e-6)
    unfused = qkv.clone()
    q, k = unfused[:, :448], unfused[:, 448:576]
    q.copy_(kernels.rms_norm.triton(q.reshape(-1, 64), q_w, 1e-6).view(q.shape))
    k.copy_(kernels.rms_norm.triton(k.reshape(-1, 64), k_w, 1e-6).view(k.shape))
    kernels.apply_rotary_emb.triton(q, k, positions, cache, 64)
    ulp = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(fused, unfused, rtol=ulp, atol=ulp)
    assert torch.equal(fused[:, 576:], before[:, 576:])  # v untouched
    ref = before.double().cpu()
    reference.apply_rotary_emb_ref(ref[:, :448], ref[:, 448:576], positions.cpu(), cache.cpu(), 64,
                                   q_w.double().cpu(), k_w.double().cpu(), 1e-6)
    assert rel_err(fused[:, :576], ref[:, :576]) < {torch.float32: 1e-5}.get(dtype, 1e-2)


def test_rotary_with_head_norms_reference_is_norm_then_rotary():
    gen = torch.Generator().manual_seed(4)
    q, k, positions, cache = _rotary_case(torch.float32, gen, head_size=64, rotary_dim=64)
    q, k, positions, cache = q.cpu(), k.cpu(), positions.cpu(), cache.cpu()
    q_w, k_w = torch.randn(64, generator=gen), torch.randn(64, generator=gen)
    fused_q, fused_k = q.clone(), k.clone()
    reference.apply_rotary_emb_ref(fused_q, fused_k, positions, cache, 64, q_w, k_w, 1e-6)
    nq = reference.rms_norm_ref(q.view(-1, 64), q_w, 1e-6).view(q.shape)
    nk = reference.rms_norm_ref(k.view(-1, 64), k_w, 1e-6).view(k.shape)
    reference.apply_rotary_emb_ref(nq, nk, positions, cache, 64)
    assert torch.equal(fused_q, nq) and torch.equal(fused_k, nk)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_float64(dtype):
    gen = torch.Generator().manual_seed(2)
    x = _randn(7, 2 * 300, dtype=dtype, gen=gen) * 3
    out = poisoned((7, 300), dtype)
    kernels.silu_and_mul.triton(x, out=out, block=128)  # 3 column blocks, the last partial
    x_cpu = x.cpu()
    assert_accurate(out, reference.silu_and_mul_ref(x_cpu.double()),
                    F.silu(x_cpu[:, :300]) * x_cpu[:, 300:])


def test_silu_and_mul_reference_is_x_sigmoid_x_times_up():
    x = torch.randn(4, 10, dtype=torch.float64)
    assert torch.allclose(reference.silu_and_mul_ref(x), x[:, :5] * torch.sigmoid(x[:, :5]) * x[:, 5:])


@pytest.mark.parametrize("call, message", [
    (lambda: kernels.rms_norm.triton(torch.randn(2, 8, device=DEVICE), torch.randn(4, device=DEVICE), 1e-6),
     "rms_norm: weight must have shape [H] = (8,), got (4,)"),
    (lambda: kernels.rms_norm.triton(torch.randn(2, 8, device=DEVICE), torch.randn(8, device=DEVICE), 1e-6,
                              torch.randn(2, 8, device=DEVICE).half()),
     "rms_norm: residual must have the dtype of x (torch.float32), got torch.float16"),
    (lambda: kernels.silu_and_mul.triton(torch.randn(2, 7, device=DEVICE)),
     "silu_and_mul: x last dimension must be even (cat(gate, up)), got 7"),
    (lambda: kernels.apply_rotary_emb.triton(torch.randn(2, 128, device=DEVICE), torch.randn(2, 64, device=DEVICE),
                                      torch.zeros(2, dtype=torch.int64, device=DEVICE),
                                      torch.randn(10, 64, dtype=torch.float64, device=DEVICE)),
     "apply_rotary_emb: cos_sin_cache must have dtype torch.float32, got torch.float64"),
    (lambda: kernels.apply_rotary_emb.triton(torch.randn(2, 100, device=DEVICE), torch.randn(2, 64, device=DEVICE),
                                      torch.zeros(2, dtype=torch.int64, device=DEVICE),
                                      torch.randn(10, 64, device=DEVICE)),
     "apply_rotary_emb: query width 100 and key width 64 must be multiples of head_size 64"),
    (lambda: kernels.apply_rotary_emb.triton(torch.randn(2, 128, device=DEVICE), torch.randn(2, 64, device=DEVICE),
                                      torch.zeros(2, dtype=torch.int64, device=DEVICE),
                                      torch.randn(10, 64, device=DEVICE), 64, torch.ones(64, device=DEVICE)),
     "apply_rotary_emb: q_norm_weight and k_norm_weight must be given together"),
    (lambda: kernels.apply_rotary_emb.triton(torch.randn(2, 128, device=DEVICE), torch.randn(2, 64, device=DEVICE),
                                      torch.zeros(2, dtype=torch.int64, device=DEVICE),
                                      torch.randn(10, 64, device=DEVICE), 64, torch.ones(32, device=DEVICE),
                                      torch.ones(64, device=DEVICE)),
     "apply_rotary_emb: q_norm_weight must have shape [head_size] = (64,), got (32,)"),
    (lambda: kernels.apply_rotary_emb.triton(torch.randn(2, 128, device=DEVICE), torch.randn(2, 64, device=DEVICE),
                                      torch.zeros(2, dtype=torch.int64, device=DEVICE),
                                      torch.randn(10, 32, device=DEVICE), 64, torch.ones(64, device=DEVICE),
                                      torch.ones(64, device=DEVICE)),
     "apply_rotary_emb: per-head norms need rotary_dim == head_size, got 32 and 64"),
])
def test_fused_ops_reject_bad_arguments(call, message):
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        call()
