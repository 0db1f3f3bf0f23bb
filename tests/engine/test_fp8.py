"""quantization="fp8": FP8 weights (per-channel scales) and per-token FP8 activations in the
decoder's linear layers. On the CPU the FP8 matmul is emulated with the same rounding of both
inputs, so the engine must match, token for token, a Hugging Face model whose linear layers apply
the same quantize-dequantize by hand."""
from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy_generate
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from tritium import LLM, EngineArgs, SamplingParams
from tritium.layers.linear import LinearBase
from tritium.kernels import reference

MAX_NEW = 12
PROMPTS = ["The engine streams tokens", "A paged cache holds blocks of keys and values",
           "x", "GPU kernels read the cache in place while the scheduler batches users"]


def fake_quant_linear(linear: nn.Linear):
    """Replace an HF linear's forward with: x and W rounded to FP8 (per token / per output
    channel), then an ordinary float32 matmul of the dequantized values."""
    w = linear.weight.data.float()
    w_scale = (w.abs().amax(dim=1) / 448.0).clamp(min=1e-12)
    w_deq = (w / w_scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).float() * w_scale[:, None]

    def forward(x):
        shape = x.shape
        q, s = reference.quantize_fp8_per_token_ref(x.reshape(-1, shape[-1]))
        y = (q.float() * s) @ w_deq.t()
        if linear.bias is not None:
            y = y + linear.bias
        return y.reshape(*shape[:-1], -1).to(x.dtype)
    linear.forward = forward


def hf_fp8_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    count = 0
    for layer in model.model.layers:
        # q/k/v and gate/up apart, or fused as Phi-3 has them (per-row scales are the same)
        for lin in [*layer.self_attn.children(), *layer.mlp.children()]:
            if isinstance(lin, nn.Linear):
                fake_quant_linear(lin)
                count += 1
    assert count in (4 * len(model.model.layers), 7 * len(model.model.layers))
    return hf_greedy_generate(model, prompts, MAX_NEW)


def test_fp8_engine_matches_hf_with_the_same_fake_quantization(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    # The CPU's emulated FP8 matmul rounds exactly as the fake-quantized HF model does; a GPU's
    # FP8 tensor cores accumulate in another order, so this comparison is CPU-only by design.
    llm = LLM(model_dir, dtype="float32", device="cpu", quantization="fp8")
    linears = [m for m in llm.engine.executor.worker.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
    assert all(m.weight_scale.shape == (1, m.weight.shape[0]) for m in linears)
    assert llm.engine.executor.worker.model.lm_head.weight.dtype == torch.float32  # the head stays 16/32-bit
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_fp8_greedy(model_dir, prompts)


def test_per_token_quantization_reference():
    x = torch.randn(6, 300) * torch.tensor([1e-3, 1.0, 50.0, 0.0, 7.0, 300.0])[:, None]
    q, s = reference.quantize_fp8_per_token_ref(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (6, 1)
    assert torch.equal(q[3].float(), torch.zeros(300)) and s[3].item() == pytest.approx(1e-12)
    for row in (0, 1, 2, 4, 5):
        assert q[row].float().abs().max().item() == 448.0  # each row uses the full range
        # e4m3 keeps 3 mantissa bits: relative rounding error at most 2**-4 of the value.
        err = (q[row].float() * s[row] - x[row]).abs()
        assert (err <= x[row].abs() * 2 ** -4 + s[row] * 2 ** -9).all()


def test_unknown_quantization_is_a_clear_error(llama_dir):
    with pytest.raises(ValueError, match=r"^quantization must be one of fp8, awq, gptq; got 'int4'\.$"):
        EngineArgs(model=llama_dir, quantization="int4")
    args = EngineArgs.from_strings({"model": llama_dir, "quantization": "none"})
    assert args.quantization is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the FP8 matmuls run on a GPU only")
@pytest.mark.parametrize("rows", [1, 4, 16, 17, 64])
def test_fp8_linear_takes_our_kernel_up_to_16_rows(rows, monkeypatch):
    """Decode batches of at most 16 rows go to kernels.fp8_matmul_few_rows, larger ones to
    torch._scaled_mm; both give the dequantized product within bf16 rounding."""
    from types import SimpleNamespace

    from tritium import kernels
    from tritium.layers.quantization import Fp8LinearMethod
    w = torch.randn(256, 512, device="cuda") * 0.05
    layer = SimpleNamespace(weight=w.to(torch.bfloat16))
    method = Fp8LinearMethod()
    method.process_weights_after_loading(layer)
    calls = []
    real = kernels.fp8_matmul_few_rows
    monkeypatch.setattr(kernels, "fp8_matmul_few_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    out = method.apply(layer, x, None)
    q, s = reference.quantize_fp8_per_token_ref(x)
    want = (q.float() * s) @ (layer.weight.float() * layer.weight_scale.t()).t()
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 256)
    assert ((out.float() - want).norm() / want.norm()).item() < 1e-2
    assert len(calls) == (1 if rows <= 16 else 0)


def test_norms_and_the_activation_quantize_for_the_fp8_projections(model_dir, monkeypatch):
    """Both norms of a layer and its SiLU-and-mul hand their FP8 projection an input they
    quantized in their own launch; only the attention output is quantized apart (by o_proj).
    With a LoRA adapter on a projection, its input stays 16-bit (the adapter multiplies it)."""
    from tritium import kernels
    calls = {name: 0 for name in ("rms_norm_quant_fp8", "silu_and_mul_quant_fp8", "quantize_fp8_per_token")}
    for name in calls:
        op = getattr(kernels, name)

        def counted(*args, _op=op, _name=name, **kwargs):
            calls[_name] += 1
            return _op(*args, **kwargs)
        monkeypatch.setattr(kernels, name, counted)
    llm = LLM(model_dir, dtype="float32", device="cpu", quantization="fp8")
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    passes = calls["silu_and_mul_quant_fp8"]  # one per layer per forward pass
    assert passes > 0 and calls == {"rms_norm_quant_fp8": 2 * passes, "silu_and_mul_quant_fp8": passes,
                                    "quantize_fp8_per_token": passes}
    layer = llm.engine.executor.worker.model.model.layers[0]
    assert layer.self_attn.qkv_proj.takes_fp8_activation and layer.mlp.takes_fp8_activation
    layer.mlp.gate_up_proj.lora = object()  # (what backend/worker/lora.py sets)
    assert not layer.mlp.takes_fp8_activation and layer.mlp.down_proj.takes_fp8_activation


def test_split_k_slices_reach_the_next_norm(model_dir, monkeypatch):
    """Where a GPU's matmul splits K, o_proj and down_proj hand the RMSNorm after them their
    slices (SplitKPartials) and the norm adds them: here every such call returns two halves of
    its output as slices, and the tokens must stay Hugging Face's; each layer's o_proj and
    down_proj are asked, the next norm being an RMSNorm (the last layer's: the final norm)."""
    from tritium.layers.quantization import Fp8LinearMethod
    from tritium.layers.split_k_partials import SplitKPartials
    apply, asked = Fp8LinearMethod.apply, []

    def halves(self, layer, x, bias, keep_partials=False):
        y = apply(self, layer, x, bias)
        if not keep_partials:
            return y
        asked.append(layer)
        return SplitKPartials(torch.stack([y.float() * 0.5, y.float() * 0.5]), y.dtype)
    monkeypatch.setattr(Fp8LinearMethod, "apply", halves)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:2]]
    llm = LLM(model_dir, dtype="float32", device="cpu", quantization="fp8")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_fp8_greedy(model_dir, prompts)
    layers = llm.engine.executor.worker.model.model.layers
    wanted = {id(m) for layer in layers for m in (layer.self_attn.o_proj, layer.mlp.down_proj)}
    assert asked and {id(m) for m in asked} == wanted
