"""The typed, architecture-neutral description of a decoder-only model, read once from its
config.json: what the engine and the shared layers need (sizes, rope, norms, biases, experts).
A family file states only how its config differs from the common reading (its defaults)."""
from __future__ import annotations

from dataclasses import dataclass

from ..layers.rotary import rope_type


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's (and Mixtral's experts')
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head before rotary
    rotary_dim: int = 0  # the leading dims of each head that rotate (Phi-3's partial rotary); 0: all
    long_rope: bool = False  # LongRoPE: the long factors at every position (see models.longrope_original_length)
    # Mixture of experts: with num_experts > 0, the layers in `sparse_layers` route each token to
    # num_experts_per_tok experts of moe_intermediate_size; the others keep the dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to one
    router_weights_in_dtype: bool = True  # the routing weights rounded to the model dtype (Qwen-MoE)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert; 0: none
    sparse_layers: tuple[int, ...] = ()
    # Each layer's sliding attention window (0: the whole context), from config.json's
    # layer_types where it has them, else the family's rule (`windowed_layers`).
    layer_windows: tuple[int, ...] = ()
    hidden_act: str = "silu"  # the gated MLP's: silu (SwiGLU) or gelu_pytorch_tanh (Gemma's GeGLU)
    # Gemma: scores scaled by query_pre_attn_scalar ** -0.5 (else head_dim ** -0.5), capped by
    # C * tanh(x / C) in attention (Gemma 2) and on the final logits; the embedding times
    # sqrt(hidden_size); windowed layers rotating with their own base (Gemma 3).
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    scale_embeddings: bool = False
    local_rope_theta: float | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kv_window(self) -> int | None:
        """The most past tokens any layer attends to, when every layer has a window (None: a
        layer sees the whole context, so every block stays needed)."""
        if not self.layer_windows or not all(self.layer_windows):
            return None
        return max(self.layer_windows)

    @classmethod
    def from_hf_config(cls, c: dict, **family_defaults) -> "DecoderConfig":
        """`family_defaults`: what the family's config.json leaves implicit (Qwen2's qkv bias,
        Qwen3's head norms, Mixtral's renormalised routing, Gemma's tied embeddings);
        config.json keys still win where they name the same field (attention_bias,
        norm_topk_prob, tie_word_embeddings)."""
        heads = c["num_attention_heads"]
        rope = dict(c.get("rope_parameters") or {})  # transformers 5 layout
        local_theta = c.get("rope_local_base_freq")  # Gemma 3's older layout
        if "full_attention" in rope:  # transformers 5, Gemma 3: one set per layer type
            local_theta = (rope.get("sliding_attention") or {}).get("rope_theta", local_theta)
            rope = dict(rope["full_attention"])
        if c.get("rope_scaling"):
            rope.update(c["rope_scaling"])
        theta = rope.pop("rope_theta", c.get("rope_theta", 10000.0))
        partial = float(rope.pop("partial_rotary_factor", c.get("partial_rotary_factor") or 1.0))
        if rope_type(rope) == "default":
            rope = {}
        elif rope_type(rope) == "longrope":  # its lengths live in the config
            rope.setdefault("original_max_position_embeddings",
                            c.get("original_max_position_embeddings") or c.get("max_position_embeddings", 4096))
            rope.setdefault("max_position_embeddings", c.get("max_position_embeddings", 4096))
        act = c.get("hidden_activation") or c.get("hidden_act") or "silu"
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"model: hidden_act {act!r} is not supported (silu and gelu_pytorch_tanh are)")
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        fields = dict(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=c.get("num_key_value_heads") or heads,
            head_dim=head_dim, rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=rope or None, max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", family_defaults.pop("tie_word_embeddings", False))),
            attention_bias=bool(c.get("attention_bias", c.get("qkv_bias", family_defaults.pop("attention_bias", False)))),
            mlp_bias=bool(c.get("mlp_bias", False)), rotary_dim=int(head_dim * partial), hidden_act=act,
            query_pre_attn_scalar=c.get("query_pre_attn_scalar"),
            attn_logit_softcap=c.get("attn_logit_softcapping"),
            final_logit_softcap=c.get("final_logit_softcapping"),
            local_rope_theta=float(local_theta) if local_theta else None)
        fields.update(_experts(c, family_defaults.pop("norm_topk_prob", False)))
        fields["layer_windows"] = _layer_windows(c, family_defaults.pop("windowed_layers", None))
        fields.update(family_defaults)
        return cls(**fields)


def by_layer_types(c: dict, layer: int) -> bool:
    """Whether config.json's layer_types make `layer` a sliding one; without layer_types, every
    layer is (Mistral and Phi-3 apply sliding_window to all)."""
    types = c.get("layer_types")
    return not types or types[layer] == "sliding_attention"


def qwen_windowed_layers(c: dict, layer: int) -> bool:
    """Qwen2 / Qwen3 (dense and MoE): only with use_sliding_window, and then the layers
    layer_types names, or those from max_window_layers on (transformers' Qwen2Config)."""
    if not c.get("use_sliding_window", False):
        return False
    if c.get("layer_types"):
        return by_layer_types(c, layer)
    return layer >= c.get("max_window_layers", 28)


def _layer_windows(c: dict, windowed_layers) -> tuple[int, ...]:
    """Per layer: the window, or 0. `windowed_layers(config, layer) -> bool`: the family's rule
    (default: by_layer_types)."""
    layers = c["num_hidden_layers"]
    window = int(c.get("sliding_window") or 0)
    types = c.get("layer_types")
    if types and len(types) != layers:
        raise ValueError(f"model: layer_types has {len(types)} entries for {layers} layers")
    if not window:
        return (0,) * layers
    rule = windowed_layers or by_layer_types
    return tuple(window if rule(c, i) else 0 for i in range(layers))


def _experts(c: dict, norm_topk_default: bool) -> dict:
    """The mixture-of-experts fields. Mixtral names its expert count num_local_experts and
    Qwen-MoE num_experts (transformers 5 saves Qwen3-MoE's under either)."""
    num_experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
    if not num_experts:
        return {}
    top_k = int(c["num_experts_per_tok"])
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"model: num_experts_per_tok={top_k} must lie in 1..{num_experts} (num_experts)")
    step = int(c.get("decoder_sparse_step") or 1)
    dense = set(c.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(c["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
    return dict(num_experts=num_experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(c.get("moe_intermediate_size") or c["intermediate_size"]),
                norm_topk_prob=bool(c.get("norm_topk_prob", norm_topk_default)),
                shared_expert_intermediate_size=int(c.get("shared_expert_intermediate_size") or 0),
                sparse_layers=sparse)
