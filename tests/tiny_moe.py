"""Tiny mixture-of-experts models for the engine and server tests (build_default_model specs)."""

# Mixture-of-experts families, from transformers' own config classes: 8 experts, top-2.
# Mixtral renormalises the top-k weights; Qwen2-MoE does not, adds a gated shared expert and
# keeps layer 1 of 3 dense (mlp_only_layers); Qwen3-MoE renormalises (as Qwen3-30B-A3B's config
# says) with per-head q/k norms and head_dim apart from hidden_size / heads.
MIXTRAL = dict(arch="mixtral", num_attention_heads=4, num_key_value_heads=2, intermediate_size=48)
QWEN2_MOE = dict(arch="qwen2_moe", num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                 mlp_only_layers=[1], tie_word_embeddings=True)
QWEN3_MOE = dict(arch="qwen3_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 norm_topk_prob=True)
MOE_FAMILIES = {"mixtral": (MIXTRAL, 5), "qwen2_moe": (QWEN2_MOE, 6), "qwen3_moe": (QWEN3_MOE, 7)}
