"""Build random-weight EAGLE draft heads for a target model, in the published checkpoint layouts
(docs/speculative_decoding.md, "EAGLE checkpoint layout"): config.json and model.safetensors.
For tests and benchmarks: such a head's drafts are not meant to be accepted.

    python scripts/build_eagle_head.py --target models/tiny-llama --out models/tiny-llama-eagle3
    python scripts/build_eagle_head.py --method eagle --target models/tiny-llama --out models/tiny-llama-eagle
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file

_CONFIG_KEYS = ("hidden_act", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
                "max_position_embeddings",
                "vocab_size", "bos_token_id", "eos_token_id", "attention_bias", "mlp_bias")


def _target_config(target_dir: str) -> dict:
    with open(os.path.join(target_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def _head_config(target: dict, architecture: str, hidden_size: int | None,
                 num_hidden_layers: int) -> dict:
    config = {k: target[k] for k in _CONFIG_KEYS if target.get(k) is not None}
    config.update(architectures=[architecture], model_type="llama", num_hidden_layers=num_hidden_layers,
                  hidden_size=hidden_size or target["hidden_size"], tie_word_embeddings=False,
                  torch_dtype="float32")
    if hidden_size and hidden_size != target["hidden_size"]:
        heads = config["num_attention_heads"]
        config.update(target_hidden_size=target["hidden_size"], head_dim=hidden_size // heads,
                      intermediate_size=2 * hidden_size)
    return config


def _decoder_layer(g: torch.Generator, prefix: str, config: dict, attn_in: int,
                   input_norm: bool) -> dict[str, torch.Tensor]:
    h, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj.weight": (q, attn_in), "self_attn.k_proj.weight": (kv, attn_in),
              "self_attn.v_proj.weight": (kv, attn_in), "self_attn.o_proj.weight": (h, q),
              "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
              "mlp.down_proj.weight": (h, inter), "post_attention_layernorm.weight": (h,)}
    if input_norm:
        shapes["input_layernorm.weight"] = (h,)
    return {prefix + name: _random(g, shape) for name, shape in shapes.items()}


def _random(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Linear weights scaled by 1/sqrt(fan in), so activations stay near unit size; norm weights
    near one but not one, so that each norm's weight matters."""
    if len(shape) == 1:
        return 1.0 + 0.2 * torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) / shape[1] ** 0.5


def _write(out_dir: str, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def vocab_map(target_vocab_size: int, draft_vocab_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for a random subset of the target vocabulary, kept in ascending order as
    SpecForge keeps its most frequent tokens: draft id i is target id i + d2t[i]."""
    g = torch.Generator().manual_seed(seed)
    used = torch.randperm(target_vocab_size, generator=g)[:draft_vocab_size].sort().values
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(draft_vocab_size), t2d


def eagle3_head_config(target: dict, draft_vocab_size: int = 32000) -> dict:
    """The config.json of an EAGLE-3 head of the target's shape with the published heads' draft
    vocabulary (32,000 tokens for Llama-3.1-8B's), for random weights (load_format=dummy). A
    target of fewer than five layers has no default auxiliary layers: it reads its first,
    middle and last."""
    config = _head_config(target, "LlamaForCausalLMEagle3", None, 1)
    config["draft_vocab_size"] = min(draft_vocab_size, target["vocab_size"])
    layers = target["num_hidden_layers"]
    if layers < 5:
        config["eagle_aux_hidden_state_layer_ids"] = [0, layers // 2, layers]
    return config


def build_eagle3_head(out_dir: str, target_dir: str, seed: int, draft_vocab_size: int | None = None,
                      aux_layer_ids: list[int] | None = None, hidden_size: int | None = None,
                      own_embed_tokens: bool = False, norm_before_residual: bool = False) -> str:
    """An EAGLE-3 head (SpecForge / EAGLE's layout): fc over three target layers, one midlayer,
    norm, lm_head over `draft_vocab_size` tokens with d2t / t2d. aux_layer_ids: written as
    eagle_aux_hidden_state_layer_ids (else the reader's default applies). hidden_size: the head's,
    if it differs from the target's (then it has its own embedding). own_embed_tokens: ship an
    embedding (random, unlike a trained head's copy of the target's). norm_before_residual:
    vLLM's variant whose residual is the normed hidden state."""
    target = _target_config(target_dir)
    config = _head_config(target, "LlamaForCausalLMEagle3", hidden_size, 1)
    vocab, h = target["vocab_size"], config["hidden_size"]
    draft_vocab = draft_vocab_size or vocab
    config["draft_vocab_size"] = draft_vocab
    if aux_layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    if norm_before_residual:
        config["norm_before_residual"] = True
    g = torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": _random(g, (h, 3 * target["hidden_size"]))}
    tensors.update(_decoder_layer(g, "midlayer.", config, 2 * h, input_norm=True))
    tensors.update({"midlayer.hidden_norm.weight": _random(g, (h,)), "norm.weight": _random(g, (h,)),
                    "lm_head.weight": _random(g, (draft_vocab, h))})
    if own_embed_tokens or h != target["hidden_size"]:
        tensors["embed_tokens.weight"] = 0.25 * torch.randn(vocab, h, generator=g)
    tensors["d2t"], tensors["t2d"] = vocab_map(vocab, draft_vocab, seed)
    return _write(out_dir, config, tensors)


def build_eagle1_head(out_dir: str, target_dir: str, seed: int, fc_bias: bool = True,
                      num_hidden_layers: int = 1, own_embed_tokens: bool = False,
                      state_bias: bool = True) -> str:
    """An EAGLE-1 head (EAGLE's layout): fc over cat(embedding, hidden state), decoder layers
    whose first has no input_layernorm; the target's lm_head (and embedding, unless
    own_embed_tokens). fc_bias: EAGLE's default; state_bias: write it in the config as "bias"
    (else the reader goes by the checkpoint)."""
    target = _target_config(target_dir)
    config = _head_config(target, "LlamaForCausalLM", None, num_hidden_layers)
    if state_bias:
        config["bias"] = fc_bias
    h = config["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": _random(g, (h, 2 * h))}
    if fc_bias:
        tensors["fc.bias"] = 0.1 * torch.randn(h, generator=g)
    for i in range(num_hidden_layers):
        tensors.update(_decoder_layer(g, f"layers.{i}.", config, h, input_norm=i > 0))
    if own_embed_tokens:
        tensors["embed_tokens.weight"] = 0.25 * torch.randn(target["vocab_size"], h, generator=g)
    return _write(out_dir, config, tensors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=["eagle", "eagle3"], default="eagle3")
    parser.add_argument("--target", required=True, help="the target model's directory")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft-vocab-size", type=int, default=None, help="EAGLE-3 only")
    parser.add_argument("--aux-layer-ids", type=int, nargs=3, default=None, help="EAGLE-3 only")
    args = parser.parse_args(argv)
    if args.method == "eagle3":
        build_eagle3_head(args.out, args.target, args.seed, args.draft_vocab_size, args.aux_layer_ids)
    else:
        build_eagle1_head(args.out, args.target, args.seed)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
