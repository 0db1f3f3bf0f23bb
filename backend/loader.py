"""Weight loading: Hugging Face safetensors checkpoints (single file or sharded with an index),
or random weights of the config's shapes (load_format=dummy, for benchmarks)."""
from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open
from torch import nn

# Checkpoint tensors that have no parameter in our models (recomputed, or unused).
_SKIP_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {model_dir!r} "
                         f"(use load_format=dummy for random weights)")
    return files


def load_safetensors(model: nn.Module, model_dir: str) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
    loaded: set[str] = set()
    for path in _checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith(_SKIP_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                tensor = f.get_tensor(name)
                target, shard_id = name, None
                for ckpt_frag, (param_frag, sid) in packed.items():
                    if f".{ckpt_frag}." in name:
                        target, shard_id = name.replace(ckpt_frag, param_frag), sid
                        break
                param = params.get(target)
                if param is None:
                    raise ValueError(f"model: checkpoint tensor {name!r} has no matching parameter")
                loader = getattr(param, "weight_loader", None)
                with torch.no_grad():
                    if loader is None:
                        if param.shape != tensor.shape:
                            raise ValueError(f"model: {name} has shape {tuple(tensor.shape)}, "
                                             f"expected {tuple(param.shape)}")
                        param.data.copy_(tensor)
                    elif shard_id is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard_id)
                loaded.add(target)
    missing = [n for n in params if n not in loaded and not (tied and n == "lm_head.weight")]
    if missing:
        raise ValueError(f"model: checkpoint lacks weights for {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")


def load_dummy(model: nn.Module, seed: int) -> None:
    """Small uniform random weights: real shapes and memory traffic, finite activations.
    Generated where the parameters live, since a CPU copy of 8B parameters would take minutes."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.uniform_(-1e-2, 1e-2)
