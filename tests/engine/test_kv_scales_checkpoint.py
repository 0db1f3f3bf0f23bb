"""Per-layer KV-cache scales stored in an FP8 checkpoint (llm-compressor's `self_attn.k_scale` /
`v_scale`, AutoFP8's `kv_scale`, compressed-tensors' `k_proj.output_scale`): with
kv_cache_dtype=fp8 each layer stores its keys and values with its own scales, token-exact
against Hugging Face with the same per-layer fake quantization; with a 16-bit cache they are
read and left unused. Before, such a checkpoint failed to load."""
from __future__ import annotations

import importlib
import re
import shutil

import pytest
import torch
from hf_reference import hf_greedy_generate
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tritium import LLM, SamplingParams
from tritium.models.loader import KV_SCALE_SUFFIXES, _kv_scale_target
from tritium.kernels import reference

PROMPTS = [[1, 17, 42, 99, 7, 300, 12], list(range(3, 40)), [5]]
MAX_NEW = 10
# layer 0: llm-compressor names; layer 1: AutoFP8's one scale for both
SCALES = {"model.layers.0.self_attn.k_scale": 0.05, "model.layers.0.self_attn.v_scale": 0.02,
          "model.layers.1.self_attn.kv_scale": 0.03}
PER_LAYER = [(0.05, 0.02), (0.03, 0.03)]


def _with_scales(src: str, dst: str, scales: dict[str, torch.Tensor]) -> str:
    shutil.copytree(src, dst)
    path = f"{dst}/model.safetensors"
    tensors = load_file(path)
    tensors.update(scales)
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def scaled_dir(llama_dir, tmp_path_factory) -> str:
    return _with_scales(llama_dir, str(tmp_path_factory.mktemp("scaled") / "m"),
                        {k: torch.tensor(v) for k, v in SCALES.items()})


def _fake_quant(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (reference.quantize_kv_ref(x, scale).float() * scale).to(x.dtype)


def _hf_per_layer_fp8(model_dir: str, monkeypatch) -> list[list[int]]:
    """HF greedy tokens with each layer's keys (after rotary) and values quantized with that
    layer's scales."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    module = importlib.import_module(type(model.model.layers[0].self_attn).__module__)
    rotary, current = module.apply_rotary_pos_emb, {"layer": 0}

    def rotary_then_quantize_keys(q, k, cos, sin, *args, **kwargs):
        q, k = rotary(q, k, cos, sin, *args, **kwargs)
        return q, _fake_quant(k, PER_LAYER[current["layer"]][0])

    monkeypatch.setattr(module, "apply_rotary_pos_emb", rotary_then_quantize_keys)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        attn.register_forward_pre_hook(lambda _m, _a, i=i: current.update(layer=i))
        attn.v_proj.register_forward_hook(lambda _m, _i, out, i=i: _fake_quant(out, PER_LAYER[i][1]))
    return hf_greedy_generate(model, PROMPTS, MAX_NEW)


def test_checkpoint_scales_apply_per_layer(scaled_dir, monkeypatch):
    # The engine-wide k_scale / v_scale would apply only to layers the checkpoint leaves out.
    llm = LLM(scaled_dir, dtype="float32", device="cpu", kv_cache_dtype="fp8", k_scale=0.5,
              v_scale=0.5)
    layers = llm.engine.executor.worker.attn_layers
    assert [(a.k_scale, a.v_scale) for a in layers] == [pytest.approx(s) for s in PER_LAYER]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert got == _hf_per_layer_fp8(scaled_dir, monkeypatch)


def test_layers_without_checkpoint_scales_keep_the_engine_scales(llama_dir, tmp_path):
    model = _with_scales(llama_dir, str(tmp_path / "m"),
                         {"model.layers.1.self_attn.v_proj.output_scale": torch.tensor([0.25])})
    layers = LLM(model, device="cpu", kv_cache_dtype="fp8", k_scale=0.5).engine.executor.worker.attn_layers
    assert [(a.k_scale, a.v_scale) for a in layers] == [(0.5, 1.0), (0.5, 0.25)]


def test_a_16_bit_cache_leaves_checkpoint_scales_unused(llama_dir, scaled_dir):
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    runs = [LLM(d, dtype="float32", device="cpu") for d in (scaled_dir, llama_dir)]
    assert [(a.k_scale, a.v_scale) for a in runs[0].engine.executor.worker.attn_layers] == [(1.0, 1.0)] * 2
    scaled, plain = ([(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
                      for o in r.generate(PROMPTS, params)] for r in runs)
    assert scaled == plain


@pytest.mark.parametrize("name, value, message", [
    ("model.layers.0.self_attn.k_scale", torch.tensor([0.1, 0.2]),
     "model: model.layers.0.self_attn.k_scale must hold one number, got shape (2,)"),
    ("model.layers.1.self_attn.kv_scale", torch.tensor(-1.0),
     "model: model.layers.1.self_attn.kv_scale must be a positive finite scale, got -1.0"),
    ("model.layers.7.self_attn.k_scale", torch.tensor(0.1),
     "model: KV cache scales for 'model.layers.7.self_attn', which is not an attention block of "
     "this model"),
])
def test_bad_checkpoint_scales_are_refused(llama_dir, tmp_path, name, value, message):
    model = _with_scales(llama_dir, str(tmp_path / "m"), {name: value})
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        LLM(model, device="cpu", kv_cache_dtype="fp8")


def test_scale_names():
    assert set(KV_SCALE_SUFFIXES) == {"k_scale", "v_scale", "kv_scale", "k_proj.output_scale",
                                      "v_proj.output_scale"}
    assert _kv_scale_target("model.layers.3.self_attn.k_proj.output_scale") == (
        "model.layers.3.self_attn", ("k",))
    assert _kv_scale_target("model.layers.3.self_attn.kv_scale") == ("model.layers.3.self_attn", ("k", "v"))
    assert _kv_scale_target("model.layers.3.self_attn.k_proj.weight") is None
    assert _kv_scale_target("model.layers.3.mlp.k_scale") is None
