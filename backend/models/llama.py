"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3, Mistral without sliding window), written for
serving: packed tokens of many sequences, paged attention, fused qkv and gate/up projections."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

import torch
from torch import nn

from ..layers.forward_context import select_lora_rows
from ..layers.activation import SiluAndMul
from ..layers.attention import Attention
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.layernorm import RMSNorm
from ..layers.linear import (LinearBase, LinearMethod, MergedColumnParallelLinear, QKVParallelLinear,
                             RowParallelLinear)
from ..layers.rotary import RotaryEmbedding, rope_type
from .interface import CausalLM


@dataclass
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
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

    @classmethod
    def from_hf_config(cls, c: dict) -> "LlamaArgs":
        heads = c["num_attention_heads"]
        rope = dict(c.get("rope_parameters") or {})  # transformers 5 layout
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
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"model: hidden_act {c['hidden_act']!r} is not supported (silu is)")
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=c.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=rope or None,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            # Qwen2 always has a qkv bias; Llama says so in attention_bias.
            attention_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
            mlp_bias=bool(c.get("mlp_bias", False)),
            qk_norm=c.get("model_type") == "qwen3", rotary_dim=int(head_dim * partial))


class LlamaAttention(nn.Module):
    def __init__(self, a: LlamaArgs, dtype: torch.dtype,
                 linear_method: LinearMethod | None = None) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(a.hidden_size, a.head_dim, a.num_attention_heads,
                                          a.num_key_value_heads, bias=a.attention_bias, dtype=dtype,
                                          linear_method=linear_method)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * a.head_dim
        self.kv_size = self.num_kv_heads * a.head_dim
        self.o_proj = RowParallelLinear(a.num_attention_heads * a.head_dim, a.hidden_size,
                                        bias=False, dtype=dtype, linear_method=linear_method)
        self.rotary_emb = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta,
                                          a.rope_scaling, rotary_dim=a.rotary_dim or a.head_dim,
                                          long_factors=a.long_rope)
        self.attn = Attention(self.num_heads, a.head_dim, a.head_dim ** -0.5, self.num_kv_heads)
        self.head_dim = a.head_dim
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """`rows`: project only these rows' attention outputs (see LlamaModel.forward)."""
        qkv = self.qkv_proj(hidden)
        # Strided views into qkv: rotary works in place and the attention kernels take row
        # strides, so no copies.
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # One kernel applies rotary (after Qwen3's head norms) and stores every row's keys and
        # values; then attention.
        out = self.attn(q, k, v, positions, self.rotary_emb, self.q_norm, self.k_norm)
        if rows is not None:
            if rows.numel() == 0:
                return hidden[:0]
            out = out[rows]
            select_lora_rows(rows)  # LoRA adapters follow the rows kept
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, a: LlamaArgs, dtype: torch.dtype,
                 linear_method: LinearMethod | None = None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            a.hidden_size, [a.intermediate_size] * 2, bias=a.mlp_bias, dtype=dtype,
            linear_method=linear_method)
        self.down_proj = RowParallelLinear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias,
                                           dtype=dtype, linear_method=linear_method)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, a: LlamaArgs, dtype: torch.dtype,
                 linear_method: LinearMethod | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(a, dtype, linear_method)
        self.mlp = LlamaMLP(a, dtype, linear_method)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, rows)
        if rows is not None:
            residual = residual[rows]
            if rows.numel() == 0:
                return hidden, residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, a: LlamaArgs, dtype: torch.dtype,
                 linear_method: LinearMethod | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, dtype)
        self.layers = nn.ModuleList([LlamaDecoderLayer(a, dtype, linear_method)
                                     for _ in range(a.num_hidden_layers)])
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        # Speculative decoding with an EAGLE head reads hidden states of every packed row besides
        # the sampled rows' output (see `keep_hidden_states`); left unset, nothing is kept.
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.keep_final_hidden_states = False
        self.aux_hidden_states: torch.Tensor | None = None

    def keep_hidden_states(self, layers: tuple[int, ...] = (), final: bool = False) -> None:
        """From the next forward on, `aux_hidden_states` holds every packed row's hidden states:
        with `layers` (EAGLE-3), the input of each of those decoder layers (the residual stream
        before layer i runs, Hugging Face's hidden_states[i]; i == num_hidden_layers: the last
        layer's output before the final norm), concatenated in layer order, [T, len(layers) * H];
        with `final` (EAGLE-1), the final normed hidden states, [T, H]."""
        num_layers = len(self.layers)
        ids = tuple(sorted(int(i) for i in layers))
        if len(set(ids)) != len(ids) or any(not 0 <= i <= num_layers for i in ids):
            raise ValueError(f"model: auxiliary hidden state layers {tuple(layers)} must be distinct "
                             f"layer ids in 0..{num_layers}")
        if ids and final:
            raise ValueError("model: keep either auxiliary layers' hidden states or the final ones")
        self.aux_hidden_state_layers, self.keep_final_hidden_states = ids, final
        self.aux_hidden_states = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of every token, or with `logits_indices` only of those rows, in
        that order. Later steps need every token's keys and values, but only the sampled rows'
        hidden states: the last layer stores all keys and values, then runs its output
        projection and MLP on those rows alone (a prompt chunk of 8,192 tokens saves 1/32 of
        Llama-3-8B's prefill GEMMs), unless `keep_hidden_states` asked for every row's output.
        An empty index gives an empty result."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        aux_layers = self.aux_hidden_state_layers
        kept: list[torch.Tensor] = []
        num_layers = len(self.layers)
        every_row = self.keep_final_hidden_states or num_layers in aux_layers
        rows = None if every_row else logits_indices  # the last layer's output rows
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                kept.append(hidden if residual is None else hidden + residual)
            hidden, residual = layer(positions, hidden, residual, rows if i == num_layers - 1 else None)
        if num_layers in aux_layers:
            kept.append(hidden + residual)
        if kept:
            self.aux_hidden_states = kept[0] if len(kept) == 1 else torch.cat(kept, dim=-1)
        if hidden.shape[0] == 0:
            return hidden
        hidden, _ = self.norm(hidden, residual)
        if self.keep_final_hidden_states:
            self.aux_hidden_states = hidden
        if rows is None and logits_indices is not None:
            return hidden[logits_indices]
        return hidden


class LlamaForCausalLM(CausalLM):
    # Same blocks: Qwen2 adds the qkv bias (from its config), Qwen3 an RMSNorm per query and key
    # head; Phi-3's checkpoints hold q/k/v and gate/up already fused, with partial rotary.
    architectures = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                     "Phi3ForCausalLM")
    model_types = ("llama", "qwen2", "qwen3", "mistral", "phi3")
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    lora_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                    "qkv_proj": ("qkv_proj", None), "o_proj": ("o_proj", 0),
                    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                    "gate_up_proj": ("gate_up_proj", None), "down_proj": ("down_proj", 0)}

    def checkpoint_shards(self, param_name: str) -> list[tuple[str | int, int]] | None:
        """For a checkpoint tensor that is already fused (Phi-3's qkv_proj and gate_up_proj):
        the (shard id, rows) of its parts in order, for the parameter's weight loader."""
        a = self.args
        if ".qkv_proj." in param_name:
            q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
            return [("q", q), ("k", kv), ("v", kv)]
        if ".gate_up_proj." in param_name:
            return [(0, a.intermediate_size), (1, a.intermediate_size)]
        return None

    def __init__(self, hf_config: dict, dtype: torch.dtype,
                 linear_method: LinearMethod | None = None, max_model_len: int | None = None) -> None:
        """max_model_len: the engine's; with LongRoPE, past original_max_position_embeddings the
        long factors apply at every position."""
        super().__init__()
        self.args = LlamaArgs.from_hf_config(hf_config)
        rope = self.args.rope_scaling
        if (max_model_len is not None and rope_type(rope) == "longrope"
                and max_model_len > rope["original_max_position_embeddings"]):
            self.args = replace(self.args, long_rope=True)
        # The decoder's projections use `linear_method` (e.g. FP8); the LM head stays 16-bit.
        self.model = LlamaModel(self.args, dtype, linear_method)
        self.lm_head = ParallelLMHead(self.args.vocab_size, self.args.hidden_size, dtype)
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, logits_indices)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def lora_projections(self) -> Iterator[tuple[tuple[int, str], LinearBase]]:
        for index, layer in enumerate(self.model.layers):
            yield (index, "qkv_proj"), layer.self_attn.qkv_proj
            yield (index, "o_proj"), layer.self_attn.o_proj
            yield (index, "gate_up_proj"), layer.mlp.gate_up_proj
            yield (index, "down_proj"), layer.mlp.down_proj
