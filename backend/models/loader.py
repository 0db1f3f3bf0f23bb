"""Weight loading: Hugging Face safetensors checkpoints (single file or sharded with an index),
or random weights of the config's shapes (load_format=dummy, for benchmarks)."""
from __future__ import annotations

import glob
import json
import logging
import os

import torch
from safetensors import safe_open
from torch import nn

logger = logging.getLogger(__name__)

# Checkpoint tensors that have no parameter in our models (recomputed, or unused).
_SKIP_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

# Per-layer FP8 KV-cache scales as FP8 checkpoints store them, as vLLM reads them: suffix after
# the layer's attention block ("model.layers.N.self_attn") -> which scales it sets.
# llm-compressor / compressed-tensors: k_scale and v_scale (older ones: k_proj.output_scale and
# v_proj.output_scale); AutoFP8: one kv_scale for both.
KV_SCALE_SUFFIXES = {"k_scale": ("k",), "v_scale": ("v",), "kv_scale": ("k", "v"),
                     "k_proj.output_scale": ("k",), "v_proj.output_scale": ("v",)}


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


def checkpoint_tensor_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in the checkpoint, read from the headers alone."""
    shapes = {}
    for path in _checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _kv_scale_target(name: str) -> tuple[str, tuple[str, ...]] | None:
    """("model.layers.N.self_attn", ("k",)) for a KV-cache scale tensor's name, else None."""
    for suffix, kinds in KV_SCALE_SUFFIXES.items():
        head = name[:-len(suffix) - 1]
        if name.endswith("." + suffix) and head.endswith("self_attn"):
            return head, kinds
    return None


def _scale_value(name: str, tensor: torch.Tensor) -> float:
    if tensor.numel() != 1:
        raise ValueError(f"model: {name} must hold one number, got shape {tuple(tensor.shape)}")
    value = float(tensor.float().reshape(()))
    if not 0 < value < float("inf"):
        raise ValueError(f"model: {name} must be a positive finite scale, got {value}")
    return value


def _weight_scales(files: list[str]) -> dict[str, tuple[str, torch.Tensor]]:
    """`X.weight_scale` (per tensor or channel) and `X.weight_scale_inv` (per block) tensors of
    an FP8 checkpoint as (name, tensor), by weight name `X.weight` (a first pass: a weight may
    come before its scale, in the same file or another)."""
    scales: dict[str, tuple[str, torch.Tensor]] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith((".weight_scale", ".weight_scale_inv")):
                    weight = name[:name.rindex("_scale")]
                    if weight in scales:
                        raise ValueError(f"model: {weight} has both {scales[weight][0]} and {name}")
                    scales[weight] = (name, f.get_tensor(name))
    return scales


def _dequantize(name: str, weight: torch.Tensor, scale: tuple[str, torch.Tensor] | None,
                block: tuple[int, int] | None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """An FP8 checkpoint's weight times its scale (per tensor, per output channel as [N] or
    [N, 1], or per block), in float32, the scale of each row ([N, 1] float32; None where a
    row's blocks differ) and the block scales (None unless per block). The model's linear
    method takes the weight from there; quantization="fp8" uses the row scales to get the
    checkpoint's own FP8 values back (`Fp8LinearMethod`), and stacked experts their row or
    block scales (layers/moe.py)."""
    if scale is None:
        raise ValueError(f"model: {name} is {weight.dtype} but the checkpoint has no "
                         f"{name}_scale or {name}_scale_inv to read it with")
    scale_name, scale = scale
    if scale_name.endswith("_scale_inv"):
        return _dequantize_blocks(name, weight, scale_name, scale, block)
    rows = weight.shape[0]
    if scale.numel() == 1:
        row_scale = scale.float().reshape(1, 1).expand(rows, 1)
    elif scale.numel() == rows:
        row_scale = scale.float().reshape(rows, 1)
    else:
        raise ValueError(f"model: {name}_scale has shape {tuple(scale.shape)}; only per-tensor "
                         f"and per-output-channel FP8 scales are supported")
    return weight.float() * row_scale, row_scale, None


def _dequantize_blocks(name: str, weight: torch.Tensor, scale_name: str, scale: torch.Tensor,
                       block: tuple[int, int] | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Block-wise FP8 as DeepSeek-V3 stores it (its README_WEIGHTS.md; Qwen3's FP8 releases and
    vLLM's Fp8Config read the same): `weight_scale_inv` holds one float per block of the [N, K]
    weight, [ceil(N / 128), ceil(K / 128)] (the last blocks cut short), and each weight is its
    FP8 value times its block's number, despite the name."""
    if block is None:
        raise ValueError(f"model: {scale_name} holds block-wise FP8 scales, but config.json declares "
                         f"no quantization_config.weight_block_size (quant_method 'fp8')")
    (bn, bk), (n, k) = block, weight.shape
    grid = (-(-n // bn), -(-k // bk))
    if tuple(scale.shape) != grid:
        raise ValueError(f"model: {scale_name} has shape {tuple(scale.shape)}; {name} {(n, k)} "
                         f"in {bn} x {bk} blocks needs {grid}")
    blocks = scale.float()
    widened = weight.float() * blocks.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    # Where every block of a row has one scale, the row keeps it: FP8 linear layers (one scale
    # per row) then get the checkpoint's values back, where they would otherwise round twice.
    uniform = bool((blocks == blocks[:, :1]).all())
    return widened, blocks[:, :1].repeat_interleave(bn, 0)[:n] if uniform else None, blocks


def _place(name: str, target: torch.Tensor, loader, tensor: torch.Tensor, shard_id) -> None:
    """`tensor` into `target` through the parameter's weight loader (which cuts its shard and
    places packed q/k/v, gate/up parts), or copied whole where it has none."""
    if loader is None:
        if target.shape != tensor.shape:
            raise ValueError(f"model: {name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target.shape)}")
        target.data.copy_(tensor)
    elif shard_id is None:
        loader(target, tensor)
    else:
        loader(target, tensor, shard_id)


def _rows(name: str, tensor: torch.Tensor, start: int, rows: int, parts: list) -> torch.Tensor:
    """Rows start..start+rows of a fused checkpoint tensor, which must hold all its parts."""
    total = sum(r for _, r in parts)
    if tensor.shape[0] != total:
        raise ValueError(f"model: {name} has {tensor.shape[0]} rows, expected {total} "
                         f"({' + '.join(str(r) for _, r in parts)})")
    return tensor[start:start + rows]


def _record_row_scale(name: str, param: nn.Parameter, loader, row_scale: torch.Tensor,
                      shard_id) -> None:
    """Keeps the checkpoint's scale of each of `param`'s rows as `param.checkpoint_scale`
    ([rows, 1], NaN where none), placed as the weight's rows were, so that packed projections
    and tensor-parallel shards line up with their rows."""
    recorded = getattr(param, "checkpoint_scale", None)
    if recorded is None:
        recorded = torch.full((param.shape[0], 1), float("nan"), dtype=torch.float32,
                              device=param.device)
        param.checkpoint_scale = recorded
    _place(name + "_scale", recorded, loader, row_scale, shard_id)


def load_safetensors(model: nn.Module, model_dir: str, buffers: tuple[str, ...] = (),
                     optional: frozenset[str] = frozenset(),
                     weight_block_size: tuple[int, int] | None = None) -> dict[str, dict[str, float]]:
    """Loads every parameter (and the named `buffers`) except those in `optional` the checkpoint
    lacks; returns the checkpoint's KV-cache scales, if any, as
    {attention block name ("model.layers.N.self_attn"): {"k": k_scale, "v": v_scale}}: they
    are not parameters (the model runner applies them when the cache is FP8).

    FP8 checkpoints (float8_e4m3fn weights with `weight_scale`, as AutoFP8, llm-compressor and
    vLLM's FP8 format store them) load too: each weight is widened with its scale, and the scale
    of each row is kept on the parameter (`checkpoint_scale`) for quantization="fp8". Their
    `input_scale` (a static activation scale) is not used: activations are scaled per token.
    Block-wise FP8 checkpoints (`weight_scale_inv`, `weight_block_size` from config.json's
    quantization_config) load alike, each weight times its block's scale; stacked experts keep
    their row or block scales through their parameter's `checkpoint_scale_loader`."""
    params = dict(model.named_parameters(remove_duplicate=False))
    named_buffers = dict(model.named_buffers())
    params.update({name: named_buffers[name] for name in buffers})
    kv_scales: dict[str, dict[str, float]] = {}
    files = _checkpoint_files(model_dir)
    weight_scales = _weight_scales(files)
    fp8_weights = 0
    packed = getattr(model, "packed_modules", {})
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    rename = getattr(model, "checkpoint_name", None)
    stacked = getattr(model, "checkpoint_target", None)
    loaded: set[str] = set()
    expert_shards: dict[str, set] = {}  # stacked parameter -> the (expert, part) shards placed
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith(_SKIP_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                if name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
                    continue  # read with their weights above; activations scale per token
                tensor = f.get_tensor(name)
                row_scale = block_scale = None
                if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    tensor, row_scale, block_scale = _dequantize(name, tensor, weight_scales.get(name),
                                                                 weight_block_size)
                    fp8_weights += 1
                scale_target = _kv_scale_target(name)
                if scale_target is not None:
                    block, kinds = scale_target
                    value = _scale_value(name, tensor)
                    kv_scales.setdefault(block, {}).update({kind: value for kind in kinds})
                    continue
                ours = rename(name) if rename is not None else name
                target, shard_id = ours, None
                # One expert's projection goes into its layer's stacked experts; other names
                # through packed_modules (q/k/v and gate/up fused).
                placed = stacked(ours) if stacked is not None else None
                if placed is not None:
                    target, shard_id = placed
                    expert_shards.setdefault(target, set()).add(shard_id)
                else:
                    for ckpt_frag, (param_frag, sid) in packed.items():
                        if f".{ckpt_frag}." in ours:
                            target, shard_id = ours.replace(ckpt_frag, param_frag), sid
                            break
                param = params.get(target)
                if param is None:
                    raise ValueError(f"model: checkpoint tensor {name!r} has no matching parameter")
                loader = getattr(param, "weight_loader", None)
                # Packed formats (layers/int4.py) keep the outputs of a tensor elsewhere than in
                # its rows: the parameter turns it into rows; a tensor of the whole input
                # (GPTQ's g_idx) is the same for every part.
                to_rows = getattr(param, "checkpoint_rows", None)
                if to_rows is not None:
                    tensor = to_rows(name, tensor)
                # A tensor the checkpoint already fuses goes in part by part (each part's rows).
                parts = [(shard_id, None)]
                if (shard_id is None and loader is not None and hasattr(model, "checkpoint_shards")
                        and not getattr(param, "whole_input", False)):
                    parts = model.checkpoint_shards(name) or parts
                with torch.no_grad():
                    start = 0
                    for sid, rows in parts:
                        part = tensor if rows is None else _rows(name, tensor, start, rows, parts)
                        _place(name, param, loader, part, sid)
                        if placed is not None and (row_scale is not None or block_scale is not None):
                            # One expert's projection: its scales go to its (expert, part).
                            param.checkpoint_scale_loader(param, row_scale if block_scale is None
                                                          else block_scale, sid, block_scale is not None)
                        elif row_scale is not None:  # ([N, 1]: one per row of the tensor)
                            scale = row_scale if rows is None else _rows(name, row_scale, start, rows, parts)
                            _record_row_scale(name, param, loader, scale, sid)
                        start += rows or 0
                loaded.add(target)
    missing = [n for n in params if n not in loaded and n not in optional
               and not (tied and n == "lm_head.weight")]
    _check_experts_complete(params, expert_shards)
    if missing:
        raise ValueError(f"model: checkpoint lacks weights for {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")
    if fp8_weights:
        logger.info("Read %d FP8 weights with their scales; served in FP8 with quantization=fp8, "
                    "else in the model dtype", fp8_weights)
    return kv_scales


def _check_experts_complete(params: dict, placed: dict[str, set]) -> None:
    """Stacked experts load as one parameter per layer: each expert's every projection must be
    in the checkpoint, else that expert's rows would stay uninitialised."""
    for name, shards in placed.items():
        expected = getattr(params[name], "expert_shards", ())
        for expert, part in sorted(set(expected) - shards):
            layer = name.split(".layers.")[1].split(".")[0] if ".layers." in name else "?"
            raise ValueError(f"model: checkpoint lacks layer {layer} expert {expert}'s {part} "
                             f"projection ({name})")


def load_dummy(model: nn.Module, seed: int) -> None:
    """Small uniform random weights: real shapes and memory traffic, finite activations.
    Generated where the parameters live, since a CPU copy of 8B parameters would take minutes."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            fill = getattr(param, "dummy_fill", None)  # packed integer weights fill themselves
            if fill is not None:
                fill()
            elif "norm" in name:
                param.fill_(1.0)
            else:
                param.uniform_(-1e-2, 1e-2)
