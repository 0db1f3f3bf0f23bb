"""Random PEFT LoRA adapters for the tiny test models, and Hugging Face models with an adapter
merged into their weights (W + scaling * B @ A): the reference a LoRA request must match."""
from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import save_file

_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "qkv_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
          "gate_up_proj": "mlp"}


def module_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """Checkpoint module -> (in features, out features)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, config.get("num_key_value_heads", heads) * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "qkv_proj": (hidden, q + 2 * kv), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "gate_up_proj": (hidden, 2 * inter), "down_proj": (inter, hidden)}


def write_adapter(out_dir: str, model_dir: str, targets: list[str], rank: int, alpha: float,
                  seed: int, use_rslora: bool = False, layers: list[int] | None = None,
                  scale: float = 0.3, extra_tensors: dict[str, torch.Tensor] | None = None,
                  extra_config: dict | None = None) -> str:
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) with random
    A and B (PEFT starts B at zero; random B makes the adapter change the output)."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    shapes = module_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers if layers is not None else range(config["num_hidden_layers"]):
        for module in targets:
            fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{_BLOCK[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = scale * torch.randn(rank, fan_in, generator=gen)
            tensors[f"{prefix}.lora_B.weight"] = scale * torch.randn(fan_out, rank, generator=gen)
    tensors.update(extra_tensors or {})
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets,
                      "use_rslora": use_rslora, "bias": "none", "lora_dropout": 0.0,
                      "fan_in_fan_out": False, "modules_to_save": None}
    adapter_config.update(extra_config or {})
    with open(os.path.join(out_dir, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(adapter_config, f)
    return out_dir


def merged_hf_model(model_dir: str, adapter_dir: str | None):
    """The Hugging Face model (float32) with the adapter merged into its weights."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return model
    with open(os.path.join(adapter_dir, "adapter_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    r = config["r"]
    scaling = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
    params = dict(model.named_parameters())
    with safe_open(os.path.join(adapter_dir, "adapter_model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        with torch.no_grad():
            for key in sorted(k for k in keys if k.endswith(".lora_A.weight")):
                module = key[len("base_model.model."):-len(".lora_A.weight")]
                a, b = f.get_tensor(key), f.get_tensor(key.replace("lora_A", "lora_B"))
                params[module + ".weight"] += scaling * (b @ a)
    return model
