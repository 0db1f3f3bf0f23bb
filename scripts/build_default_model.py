"""Build tiny random-weight models of real architectures, with a byte-level BPE tokenizer
trained here on scripts/data/corpus.txt. Offline; used by `make serve` (the embedded default
model) and by the tests. The output of such a model is not meaningful text.

    python scripts/build_default_model.py [--out models/tiny-llama] [--arch llama|qwen2|qwen3|phi3|
        mistral|gemma2|gemma3|mixtral|qwen2_moe|qwen3_moe]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "data", "corpus.txt")
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# The default model's chat template (the frontend applies it): each turn as <|role|>, its text
# and EOS; tools and tool calls as JSON; the assistant's turn opened by add_generation_prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|tools|>\n{{ tools | tojson }}{{ eos_token }}\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content or '' }}"
    "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def add_chat_template(out_dir: str) -> str:
    """Write chat_template.jinja (where transformers looks for it) unless the model has one."""
    path = os.path.join(out_dir, "chat_template.jinja")
    if not os.path.exists(path):
        with open(path, "w", encoding="utf-8") as f:
            f.write(CHAT_TEMPLATE)
    return path


def build_tokenizer(out_dir: str, vocab_size: int = 512, add_bos: bool = True):
    """Train a byte-level BPE tokenizer (GPT-2 / Llama-3 style) and save it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([CORPUS], trainer)
    bos_id = tok.token_to_id(BOS)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(out_dir)
    return fast


def build_model(out_dir: str, arch: str = "llama", seed: int = 0, vocab_size: int = 512,
                hidden_size: int = 64, intermediate_size: int = 128, num_hidden_layers: int = 2,
                num_attention_heads: int = 4, num_key_value_heads: int = 2,
                tie_word_embeddings: bool = False, max_position_embeddings: int = 2048,
                rope_scaling: dict | None = None, max_shard_size: str | None = None,
                dtype: str = "float32", add_bos: bool = True, head_dim: int | None = None,
                **family_fields) -> str:
    """Write config.json, *.safetensors and the tokenizer of a tiny model into out_dir. `family_fields`:
    further config fields of the family's config class (experts, sliding windows)."""
    import torch
    from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig,
                              MixtralConfig, Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

    os.makedirs(out_dir, exist_ok=True)
    tok = build_tokenizer(out_dir, vocab_size, add_bos=add_bos)
    common = dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                  num_key_value_heads=num_key_value_heads, tie_word_embeddings=tie_word_embeddings,
                  max_position_embeddings=max_position_embeddings,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if arch == "llama":
        config = LlamaConfig(**common, rope_scaling=rope_scaling, rms_norm_eps=1e-5)
    elif arch == "qwen2":
        config = Qwen2Config(**common, rms_norm_eps=1e-6)
    elif arch == "qwen3":
        # Qwen3 sets head_dim apart from hidden_size / heads (Qwen3-0.6B: 1024 wide, 16 x 128).
        config = Qwen3Config(**common, head_dim=head_dim or hidden_size // num_attention_heads,
                             rms_norm_eps=1e-6)
    elif arch == "phi3":
        # Phi-3: fused qkv_proj and gate_up_proj in the checkpoint; half of each head rotates here
        # (Phi-4-mini's 0.75, Phi-3's 1.0), so the partial rotary path is exercised.
        config = Phi3Config(**common, rms_norm_eps=1e-5, partial_rotary_factor=0.5,
                            pad_token_id=tok.eos_token_id)
    elif arch == "mistral":  # `family_fields` may carry its sliding_window
        config = MistralConfig(**common, rms_norm_eps=1e-5, **{"sliding_window": 32, **family_fields})
    elif arch in ("gemma2", "gemma3"):  # windows of 16 by default; query scale apart from head_dim
        cls = Gemma2Config if arch == "gemma2" else Gemma3TextConfig
        config = cls(**common, head_dim=head_dim or hidden_size // num_attention_heads, rms_norm_eps=1e-6,
                     **{"sliding_window": 16, "query_pre_attn_scalar": 24, **family_fields})
    elif arch == "mixtral":
        config = MixtralConfig(**common, rms_norm_eps=1e-5, **{"num_local_experts": 8, "num_experts_per_tok": 2, **family_fields})
    elif arch == "qwen2_moe":
        config = Qwen2MoeConfig(**common, rms_norm_eps=1e-6, **{
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 96, **family_fields})
    elif arch == "qwen3_moe":
        config = Qwen3MoeConfig(**common, head_dim=head_dim or hidden_size // num_attention_heads,
                                rms_norm_eps=1e-6, **{"num_experts": 8, "num_experts_per_tok": 2,
                                                      "moe_intermediate_size": 32, **family_fields})
    else:
        raise ValueError(f"unknown arch {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    # HF's init uses std 0.02: logits then barely depend on the input and greedy decoding
    # repeats one token. Larger weights make the tiny model's output vary with its input.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # (stacked experts: [E, out, in])
                p.normal_(0.0, 0.25 if "embed" in name else 1.0 / p.shape[-1] ** 0.5)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
            elif arch.startswith("gemma") and name.endswith("norm.weight"):
                p.normal_(0.0, 0.2)  # Gemma's norms hold offsets from one
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.2)  # Qwen3's per-head norms: not all ones, so that they matter
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    add_chat_template(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "models", "tiny-llama"))
    parser.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3", "phi3", "mistral", "gemma2", "gemma3", "mixtral",
                                                            "qwen2_moe", "qwen3_moe"])
    parser.add_argument("--force", action="store_true", help="rebuild even if it exists")
    args = parser.parse_args(argv)
    if os.path.isfile(os.path.join(args.out, "config.json")) and not args.force:
        add_chat_template(args.out)  # a model built before the template existed gets it
        print(f"{args.out} already exists")
        return 0
    build_model(args.out, arch=args.arch)
    with open(os.path.join(args.out, "config.json"), encoding="utf-8") as f:
        print(f"built {args.out}: {json.load(f)['model_type']} with random weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
