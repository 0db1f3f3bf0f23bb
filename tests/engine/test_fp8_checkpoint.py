"""FP8 checkpoints (float8_e4m3fn linear weights with `weight_scale`, per tensor or per output
channel, maybe an unused `input_scale`, as AutoFP8 / llm-compressor write them): the engine
reads each weight times its scale, so it serves exactly what a checkpoint of those widened
weights gives, with or without quantization="fp8"; a config.json that declares FP8 selects
quantization="fp8" by itself. Before, such a checkpoint failed to load."""
from __future__ import annotations

import glob
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tritium import LLM, SamplingParams

# (Phi-3's checkpoints hold qkv_proj and gate_up_proj already fused.)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
           "gate_up_proj")
PROMPTS = [[1, 17, 42, 99, 7, 300, 12], list(range(3, 40)), [5]]


def _quantize(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    amax = w.float().abs().amax(dim=1, keepdim=True) if per_channel else w.float().abs().amax()
    scale = amax / 448.0
    return (w.float() / scale).to(torch.float8_e4m3fn), scale


def _fp8_and_widened(src: str, root: str, per_channel: bool, scales_apart: bool) -> tuple[str, str]:
    """An FP8 copy of the checkpoint and a copy holding exactly its widened weights. With
    `scales_apart` the scales sit in a file of their own, listed in the index."""
    fp8_dir, wide_dir = os.path.join(root, "fp8"), os.path.join(root, "wide")
    shutil.copytree(src, fp8_dir)
    shutil.copytree(src, wide_dir)
    scales = {}
    for path in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        tensors = load_file(path)
        fp8, wide = dict(tensors), dict(tensors)
        for name, w in tensors.items():
            if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
                q, scale = _quantize(w, per_channel)
                fp8[name], wide[name] = q, (q.float() * scale).to(w.dtype)
                scales[name + "_scale"] = scale
        if not scales_apart:
            fp8.update({k: v for k, v in scales.items() if k[:-len("_scale")] in tensors})
        base = os.path.basename(path)
        save_file(fp8, os.path.join(fp8_dir, base), metadata={"format": "pt"})
        save_file(wide, os.path.join(wide_dir, base), metadata={"format": "pt"})
    extra = {"model.layers.0.self_attn.q_proj.input_scale": torch.tensor(0.5)}  # not used
    if scales_apart:
        extra.update(scales)
    save_file(extra, os.path.join(fp8_dir, "scales.safetensors"), metadata={"format": "pt"})
    index = os.path.join(fp8_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            meta = json.load(f)
        meta["weight_map"].update({k: "scales.safetensors" for k in extra})
        with open(index, "w") as f:
            json.dump(meta, f)
    return fp8_dir, wide_dir


def _outputs(model_dir: str, **engine) -> list[tuple[list[int], float]]:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    outs = LLM(model_dir, dtype="float32", device="cpu", **engine).generate(PROMPTS, params)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_checkpoint_serves_its_widened_weights(model_dir, tmp_path, per_channel):
    # Qwen2's checkpoint is sharded: its scales go to a file of their own.
    fp8_dir, wide_dir = _fp8_and_widened(model_dir, str(tmp_path), per_channel,
                                         scales_apart="qwen" in model_dir)
    assert _outputs(fp8_dir) == _outputs(wide_dir)
    if per_channel:  # each row's maximum is 448 here, so re-quantizing the widened rows is exact
        assert _outputs(fp8_dir, quantization="fp8") == _outputs(wide_dir, quantization="fp8")


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), ("cpu", "bfloat16"),
                                           pytest.param("cuda", "bfloat16", marks=GPU)])
@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_checkpoint_keeps_its_values_and_scales(model_dir, tmp_path, per_channel, device, dtype):
    """With quantization="fp8" each projection holds the checkpoint's own FP8 bytes and scales
    (q/k/v and gate/up packed in order), not the widened weights quantized again: with one
    scale per tensor most rows stay below 448, and a second rounding would change them."""
    fp8_dir, _ = _fp8_and_widened(model_dir, str(tmp_path), per_channel,
                                  scales_apart="qwen" in model_dir)
    checkpoint = {}
    for path in glob.glob(os.path.join(fp8_dir, "*.safetensors")):
        checkpoint.update(load_file(path))
    model = LLM(fp8_dir, device=device, dtype=dtype, quantization="fp8").engine.executor.worker.model
    packs = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    checked = 0
    for i, layer in enumerate(model.model.layers):
        for block, module in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                linear = getattr(module, name, None)
                if linear is None:
                    continue
                fused = f"model.layers.{i}.{block}.{name}.weight"
                parts = [fused] if fused in checkpoint else \
                    [f"model.layers.{i}.{block}.{p}.weight" for p in packs.get(name, (name,))]
                want = torch.cat([checkpoint[p] for p in parts])
                scales = torch.cat([checkpoint[p + "_scale"].float().reshape(-1, 1)
                                    .expand(checkpoint[p].shape[0], 1) for p in parts])
                assert torch.equal(linear.weight.view(torch.uint8).cpu(), want.view(torch.uint8)), parts[0]
                assert torch.equal(linear.weight_scale.view(-1).cpu(), scales.view(-1)), parts[0]
                checked += 1
    assert checked == 4 * len(model.model.layers)


def test_fp8_checkpoint_differs_from_the_original(llama_dir, tmp_path):
    """The widened weights are the FP8 ones (not the originals read back): logprobs move."""
    fp8_dir, _ = _fp8_and_widened(llama_dir, str(tmp_path), False, False)
    assert [lp for _, lp in _outputs(fp8_dir)] != [lp for _, lp in _outputs(llama_dir)]


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("model.layers.0.self_attn.q_proj.weight_scale"),
     "model: model.layers.0.self_attn.q_proj.weight is torch.float8_e4m3fn but the checkpoint has "
     "no model.layers.0.self_attn.q_proj.weight_scale or model.layers.0.self_attn.q_proj.weight_scale_inv "
     "to read it with"),
    (lambda t: t.update({"model.layers.1.mlp.down_proj.weight_scale": torch.ones(2, 2)}),
     "model: model.layers.1.mlp.down_proj.weight_scale has shape (2, 2); only per-tensor and "
     "per-output-channel FP8 scales are supported"),
])
def test_bad_fp8_checkpoints_are_refused(llama_dir, tmp_path, change, message):
    fp8_dir, _ = _fp8_and_widened(llama_dir, str(tmp_path), False, False)
    path = os.path.join(fp8_dir, "model.safetensors")
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        LLM(fp8_dir, device="cpu")


def _declare(model_dir: str, quantization_config: dict) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(path, "w") as f:
        json.dump(config, f)


FP8_CONFIGS = [
    {"quant_method": "fp8", "activation_scheme": "dynamic"},
    {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
        "input_activations": {"type": "float", "num_bits": 8, "dynamic": True}}}},
]


@pytest.mark.parametrize("declared", FP8_CONFIGS, ids=["fp8", "compressed-tensors"])
def test_a_declared_fp8_checkpoint_is_served_in_fp8(llama_dir, tmp_path, declared):
    fp8_dir, wide_dir = _fp8_and_widened(llama_dir, str(tmp_path), True, False)
    _declare(fp8_dir, declared)
    worker = LLM(fp8_dir, device="cpu").engine.executor.worker
    assert worker.quantization == "fp8"
    assert worker.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert _outputs(fp8_dir) == _outputs(wide_dir, quantization="fp8")


@pytest.mark.parametrize("declared, message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True},
     "model: the checkpoint is quantized with 'bitsandbytes', which Tritium does not read; FP8 "
     "(quant_method 'fp8' or FP8 compressed-tensors), AWQ and GPTQ checkpoints are supported"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128},
     "model: quantization_config.bits is 3; Tritium serves GPTQ checkpoints of 4 or 8 bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "model: quantization_config.checkpoint_format is 'marlin'; Tritium reads the GPTQ (v1) layout "
     "that AutoGPTQ and GPTQModel write by default, not marlin, bitblas, exllama-v2-only or "
     "gptq_v2 layouts"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "exllama"},
     "model: quantization_config.version is 'exllama'; Tritium reads AutoAWQ's GEMM layout "
     "('gemm'); re-export the checkpoint with version='gemm'"),
], ids=["bitsandbytes", "gptq-3bit", "gptq-marlin", "awq-exllama"])
def test_other_quantized_checkpoints_are_refused(llama_dir, tmp_path, declared, message):
    """AWQ and GPTQ are served (tests/engine/test_awq_gptq.py); other formats and variants are
    refused before loading, naming what the checkpoint declares."""
    model = str(tmp_path / "quantized")
    shutil.copytree(llama_dir, model)
    _declare(model, declared)
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        LLM(model, device="cpu")
