"""FP8 mixture-of-experts checkpoints of a tiny Qwen3-MoE: per-tensor or per-channel
`weight_scale` (AutoFP8, llm-compressor) and 128 x 128 block-wise `weight_scale_inv` with
quantization_config.weight_block_size (DeepSeek-V3, Qwen3-30B-A3B-FP8). Widened, they serve what
Hugging Face serves on the dequantized weights; with quantization="fp8" the experts hold the
checkpoint's own FP8 bytes and scales (per channel [E, N], per block [E, N/128, K/128]), and
greedy tokens equal a Hugging Face model of the dequantized weights with the engine's FP8
attention done by hand. Before, such checkpoints failed to load."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from hf_reference import hf_greedy_generate
from safetensors.torch import load_file, save_file
from test_fp8 import fake_quant_linear
from torch import nn
from transformers import AutoModelForCausalLM

from tritium import LLM, SamplingParams
from tritium.layers import moe as moe_layer
from tritium.layers.moe import FusedMoE
from tritium.layers.quantization import Fp8LinearMethod
from tritium.models import get_model_class
from tritium.models.loader import load_safetensors
from tritium.worker.worker_group import check_tp_shapes
from scripts.build_default_model import build_model  # (scripts/, on the path through conftest)
from tritium.kernels import reference

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [128, 128]}
PROMPTS = [[1, 17, 42, 99, 7, 300, 12], list(range(3, 40)), [5]]
MAX_NEW = 8
EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"  # the error cases' one FP8 tensor


def _per_row(w: torch.Tensor, per_tensor: bool):
    """(FP8 weight, its weight_scale [N, 1] or [], the dequantized weight), AutoFP8's way."""
    amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1, keepdim=True)
    scale = (amax / 448.0).float()
    q = (w.float() / scale).to(torch.float8_e4m3fn)
    return q, scale, q.float() * scale


def _per_block(w: torch.Tensor, uniform_rows: bool):
    """(FP8 weight, its weight_scale_inv [ceil(N/128), ceil(K/128)], the dequantized weight),
    DeepSeek-V3's way; `uniform_rows`: every block of a row of blocks gets the row's scale."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    padded = torch.zeros(nb * 128, kb * 128)
    padded[:n, :k] = w.abs()
    amax = padded.view(nb, 128, kb, 128).amax(dim=(1, 3))
    if uniform_rows:
        amax = amax.amax(dim=1, keepdim=True).expand(nb, kb)
    scale = (amax / 448.0).contiguous()
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    q = (w.float() / full).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def _declare(model_dir: str, quantization_config: dict | None) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(path, "w") as f:
        json.dump(config, f)


def _rewrite(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


def _fp8_and_widened(src: str, root: str, layout: str) -> tuple[str, str]:
    """An FP8 copy of the checkpoint (layout "tensor", "channel" or "block"; o_proj's blocks
    share one scale a row) and a copy holding exactly its dequantized weights."""
    dequantized = {}

    def quantize(tensors: dict) -> None:
        for name, w in list(tensors.items()):
            module = name.split(".")[-2]
            if not name.endswith(".weight") or module not in LINEARS:
                continue
            if layout == "block":
                tensors[name], tensors[name + "_scale_inv"], dequantized[name] = \
                    _per_block(w, uniform_rows=module == "o_proj")
            else:
                tensors[name], tensors[name + "_scale"], dequantized[name] = _per_row(w, layout == "tensor")

    fp8_dir = _rewrite(src, os.path.join(root, f"fp8-{layout}"), quantize)
    wide_dir = _rewrite(src, os.path.join(root, f"wide-{layout}"), lambda t: t.update(dequantized))
    if layout == "block":
        _declare(fp8_dir, BLOCK_CONFIG)
    return fp8_dir, wide_dir


@pytest.fixture(scope="module")
def checkpoints(moe_dirs, tmp_path_factory):
    """layout -> (FP8 dir, dequantized dir): per tensor and per channel of the session's tiny
    Qwen3-MoE (hidden 64, moe_intermediate_size 32); block-wise of one of hidden 256 and
    moe_intermediate_size 128, so that its experts hold whole 128 x 128 blocks."""
    root = str(tmp_path_factory.mktemp("fp8-moe"))
    block_src = build_model(os.path.join(root, "qwen3-moe-256"), arch="qwen3_moe", seed=12, hidden_size=256,
                            moe_intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, norm_topk_prob=True)
    return {layout: _fp8_and_widened(block_src if layout == "block" else moe_dirs["qwen3_moe"], root, layout)
            for layout in ("tensor", "channel", "block")}


def _engine_tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW))
    return [o.outputs[0].token_ids for o in outs]


def _quantize_activations(linear: nn.Linear) -> None:
    """An HF linear whose input is rounded to FP8 per token, its weight kept: Fp8LinearMethod
    with the checkpoint's own FP8 weights and scales."""
    def forward(x):
        q, s = reference.quantize_fp8_per_token_ref(x.reshape(-1, x.shape[-1]))
        return ((q.float() * s) @ linear.weight.t()).reshape(*x.shape[:-1], -1).to(x.dtype)
    linear.forward = forward


def _hf_tokens(wide_dir: str, requantized: tuple[str, ...] | None = ()) -> list[list[int]]:
    """HF on the dequantized weights; unless `requantized` is None, attention as the engine serves it
    with quantization="fp8": those projections re-quantized per row (fake_quant_linear), the
    others' FP8 weights as they are; the experts W8A16, i.e. their dequantized weights."""
    model = AutoModelForCausalLM.from_pretrained(wide_dir, dtype=torch.float32)
    if requantized is not None:
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                linear = getattr(layer.self_attn, name)
                (fake_quant_linear if name in requantized else _quantize_activations)(linear)
    return hf_greedy_generate(model, PROMPTS, MAX_NEW)


def _checkpoint(fp8_dir: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(fp8_dir, "model.safetensors"))


def _fused_moe(llm: LLM) -> list[FusedMoE]:
    return [layer.mlp.experts for layer in llm.engine.executor.worker.model.model.layers]


def test_per_channel_fp8_experts_serve_their_widened_weights(checkpoints):
    fp8_dir, wide_dir = checkpoints["channel"]
    llm = LLM(fp8_dir, dtype="float32", device="cpu")
    assert llm.engine.executor.worker.quantization is None
    assert _fused_moe(llm)[0].w13_weight.dtype == torch.float32
    assert _engine_tokens(llm) == _hf_tokens(wide_dir, requantized=None)


@pytest.mark.parametrize("layout", ["tensor", "channel"])
def test_fp8_experts_keep_the_checkpoint_bytes_and_scales(checkpoints, layout):
    """With one scale per tensor most rows stay below 448: re-quantizing the widened rows by
    their maxima (what FusedMoE does with a 16-bit checkpoint) would change their bytes."""
    fp8_dir, wide_dir = checkpoints[layout]
    ckpt = _checkpoint(fp8_dir)
    llm = LLM(fp8_dir, dtype="float32", device="cpu", quantization="fp8")
    layers = _fused_moe(llm)
    for i, moe in enumerate(layers):
        prefix = f"model.layers.{i}.mlp.experts"
        for name, parts in (("w13", ("gate_proj", "up_proj")), ("w2", ("down_proj",))):
            weights = torch.stack([torch.cat([ckpt[f"{prefix}.{e}.{p}.weight"] for p in parts]) for e in range(8)])
            scales = torch.stack([torch.cat([ckpt[f"{prefix}.{e}.{p}.weight_scale"].reshape(-1, 1).expand(
                ckpt[f"{prefix}.{e}.{p}.weight"].shape[0], 1) for p in parts]).view(-1) for e in range(8)])
            assert torch.equal(getattr(moe, f"{name}_weight").view(torch.uint8), weights.view(torch.uint8)), (i, name)
            assert torch.equal(getattr(moe, f"{name}_scale"), scales), (i, name)
    assert layers[0].w13_scale.shape == (8, 64) and layers[0].w2_scale.shape == (8, 64)
    assert _engine_tokens(llm) == _hf_tokens(wide_dir)


def test_block_fp8_checkpoint_loads_widened(checkpoints):
    """Without FP8 layers every weight, dense or expert, is its FP8 value times its block's
    scale, exactly the dequantized checkpoint's. (Served, a checkpoint that declares
    quant_method "fp8" always gets quantization="fp8", as in vLLM, so this is the loader's.)"""
    fp8_dir, wide_dir = checkpoints["block"]
    with open(os.path.join(wide_dir, "config.json")) as f:
        config = json.load(f)
    models = []
    for model_dir, block in ((fp8_dir, (128, 128)), (wide_dir, None)):
        model = get_model_class(config)(config, torch.float32)
        load_safetensors(model, model_dir, weight_block_size=block)
        models.append(dict(model.named_parameters()))
    assert models[0].keys() == models[1].keys()
    for name, param in models[0].items():
        assert torch.equal(param, models[1][name]), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_block_fp8_experts_keep_the_checkpoint_bytes_and_block_scales(checkpoints, dtype):
    """The declared checkpoint is served with quantization="fp8": experts with its FP8 bytes and
    block scales (gate's blocks, then up's); o_proj, whose blocks share one scale a row, with its
    bytes; q/k/v re-quantized per row from their widened weights (their blocks differ)."""
    fp8_dir, wide_dir = checkpoints["block"]
    ckpt, wide = _checkpoint(fp8_dir), load_file(os.path.join(wide_dir, "model.safetensors"))
    llm = LLM(fp8_dir, dtype=dtype, device="cpu")
    worker = llm.engine.executor.worker
    assert worker.quantization == "fp8"
    for i, moe in enumerate(_fused_moe(llm)):
        prefix = f"model.layers.{i}.mlp.experts"
        for name, parts in (("w13", ("gate_proj", "up_proj")), ("w2", ("down_proj",))):
            weights = torch.stack([torch.cat([ckpt[f"{prefix}.{e}.{p}.weight"] for p in parts]) for e in range(8)])
            scales = torch.stack([torch.cat([ckpt[f"{prefix}.{e}.{p}.weight_scale_inv"] for p in parts])
                                  for e in range(8)])
            assert torch.equal(getattr(moe, f"{name}_weight").view(torch.uint8), weights.view(torch.uint8)), (i, name)
            assert torch.equal(getattr(moe, f"{name}_scale"), scales), (i, name)
        assert moe.w13_scale.shape == (8, 2, 2) and moe.w2_scale.shape == (8, 2, 1)
        attn = worker.model.model.layers[i].self_attn
        o_proj = f"model.layers.{i}.self_attn.o_proj.weight"
        assert torch.equal(attn.o_proj.weight.view(torch.uint8), ckpt[o_proj].view(torch.uint8))
        assert torch.equal(attn.o_proj.weight_scale.view(-1), ckpt[o_proj + "_scale_inv"][:, 0].repeat_interleave(128))
        qkv = torch.cat([wide[f"model.layers.{i}.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
        qkv = qkv.to(getattr(torch, dtype)).float()
        row_scale = qkv.abs().amax(dim=1, keepdim=True) / 448.0
        assert torch.equal(attn.qkv_proj.weight.view(torch.uint8),
                           (qkv / row_scale).to(torch.float8_e4m3fn).view(torch.uint8))
    if dtype == "float32":
        assert _engine_tokens(llm) == _hf_tokens(wide_dir, requantized=("q_proj", "k_proj", "v_proj"))


def _one_fp8_expert(src: str, dst: str, scale_inv: torch.Tensor | None = None, both: bool = False) -> str:
    """The checkpoint with one expert projection ([64, 32]) block-wise FP8, or with a scale
    of each kind."""
    def edit(tensors: dict) -> None:
        q, scale, _ = _per_block(tensors[EXPERT], uniform_rows=False)
        tensors[EXPERT], tensors[EXPERT + "_scale_inv"] = q, scale if scale_inv is None else scale_inv
        if both:
            tensors[EXPERT + "_scale"] = scale.reshape(1).clone()
    return _rewrite(src, dst, edit)


@pytest.mark.parametrize("case, message", [
    ("block 64", "model: quantization_config.weight_block_size is [64, 64]; Tritium reads block-wise FP8 "
                 "checkpoints of [128, 128] blocks only"),
    ("undeclared", f"model: {EXPERT}_scale_inv holds block-wise FP8 scales, but config.json declares no "
                   f"quantization_config.weight_block_size (quant_method 'fp8')"),
    ("scale shape", f"model: {EXPERT}_scale_inv has shape (2, 2); {EXPERT} (64, 32) in 128 x 128 blocks "
                    f"needs (1, 1)"),
    ("both scales", f"model: {EXPERT} has both {EXPERT}_scale and {EXPERT}_scale_inv"),
    ("intermediate 32", "model: block-wise FP8 experts need a moe_intermediate_size that is a multiple of 128 "
                        "(gate and up have blocks of their own), got 32"),
])
def test_bad_block_fp8_checkpoints_are_refused(moe_dirs, tmp_path, case, message):
    src = moe_dirs["qwen3_moe"]
    model_dir = _one_fp8_expert(src, str(tmp_path / "m"), scale_inv=torch.ones(2, 2) if case == "scale shape" else None,
                                both=case == "both scales")
    declared = {"block 64": {**BLOCK_CONFIG, "weight_block_size": [64, 64]}, "undeclared": None}
    _declare(model_dir, declared.get(case, BLOCK_CONFIG))
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        LLM(model_dir, dtype="float32", device="cpu")


def test_tensor_parallelism_inside_a_block_is_refused(checkpoints):
    """Each rank must hold whole 128 x 128 blocks of every expert; checked before ranks start."""
    with open(os.path.join(checkpoints["block"][0], "config.json")) as f:
        config = json.load(f)
    check_tp_shapes(config, 1)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=2 splits the experts' moe_intermediate_size=128 "
                                         r"into 64 a rank, inside their 128 x 128 FP8 blocks\.$"):
        check_tp_shapes(config, 2)


@pytest.mark.parametrize("blocks", [False, True], ids=["per-channel", "block"])
def test_a_tensor_parallel_rank_keeps_its_slice_of_the_checkpoint(monkeypatch, blocks):
    """Rank 1 of 2 (the process group's answers set by hand, the layer real) holds the second
    half of each expert's intermediate rows: its FP8 bytes, and its rows' or blocks' scales."""
    monkeypatch.setattr(moe_layer, "get_tp_size", lambda: 2)
    monkeypatch.setattr(moe_layer, "get_tp_rank", lambda: 1)
    moe = FusedMoE(2, 256, 256, torch.float32, Fp8LinearMethod())
    torch.manual_seed(5)
    ckpt = {}
    for e in range(2):
        for part in ("gate", "up", "down"):
            w = torch.randn(256, 256) / 16
            q, scale, dequantized = _per_block(w, False) if blocks else _per_row(w, False)
            ckpt[e, part] = q, scale
            param = moe.w2_weight if part == "down" else moe.w13_weight
            moe.weight_loader(param, dequantized, (e, part))
            moe.checkpoint_scale_loader(param, scale, (e, part), blocks)
    moe.process_weights_after_loading()
    half = slice(1, 2) if blocks else slice(128, 256)  # rank 1's blocks / rows of the intermediate size
    for e in range(2):
        (gate, gate_s), (up, up_s), (down, down_s) = (ckpt[e, p] for p in ("gate", "up", "down"))
        assert torch.equal(moe.w13_weight[e].view(torch.uint8), torch.cat([gate[128:], up[128:]]).view(torch.uint8))
        assert torch.equal(moe.w2_weight[e].view(torch.uint8), down[:, 128:].view(torch.uint8))
        if blocks:
            assert torch.equal(moe.w13_scale[e], torch.cat([gate_s[half], up_s[half]]))
            assert torch.equal(moe.w2_scale[e], down_s[:, half])
        else:
            assert torch.equal(moe.w13_scale[e], torch.cat([gate_s[half], up_s[half]]).view(-1))
            assert torch.equal(moe.w2_scale[e], down_s.view(-1))
