"""The decoder-only transformer every family file builds on: embedding, layers of self-attention
and an MLP (dense, or mixture-of-experts where the config says), final norm, LM head. Written for
serving: packed tokens of many sequences, paged attention, fused q/k/v and gate/up projections,
experts stacked per layer."""
from __future__ import annotations

import re
from typing import ClassVar, Iterator

import torch
from torch import nn

from ..layers.attention import Attention
from ..layers.attention_block import SelfAttention
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.layernorm import RMSNorm
from ..layers.linear import LinearBase, LinearMethod
from ..layers.mlp import GatedMLP
from ..layers.moe import SparseMoeBlock
from ..layers.split_k_partials import SplitKPartials
from .decoder_config import DecoderConfig
from .interface import CausalLM

# One expert's projection in a checkpoint: "<prefix>.experts.<e>.<projection>.weight".
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


class DecoderLayer(nn.Module):
    def __init__(self, c: DecoderConfig, mlp: nn.Module, dtype: torch.dtype,
                 linear_method: LinearMethod | None = None, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = SelfAttention(c, dtype, linear_method, layer)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | SplitKPartials,
                residual: torch.Tensor | None, rows: torch.Tensor | None = None,
                keep_partials: bool = False) -> tuple[torch.Tensor | SplitKPartials, torch.Tensor]:
        """hidden: the previous layer's output (its split-K slices where it kept them);
        keep_partials: this layer's MLP output may be left as slices for the next RMSNorm."""
        # FP8 projections get their inputs quantized by the norms' own launches.
        fp8_qkv = isinstance(self.input_layernorm, RMSNorm) and self.self_attn.qkv_proj.takes_fp8_activation
        if residual is None:
            residual = hidden
            normed = self.input_layernorm(hidden, quantize_fp8=True) if fp8_qkv else self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual, quantize_fp8=fp8_qkv)
        # A split-K output projection's slices go to the norm after it, which adds them.
        hidden = self.self_attn(positions, normed, rows, keep_partials=True)
        if rows is not None:
            residual = residual[rows]
            if rows.numel() == 0:
                return hidden, residual
        gated = isinstance(self.mlp, GatedMLP)
        normed, residual = self.post_attention_layernorm(hidden, residual,
                                                         quantize_fp8=gated and self.mlp.takes_fp8_activation)
        return (self.mlp(normed, keep_partials) if gated else self.mlp(normed)), residual


class DecoderModel(nn.Module):
    def __init__(self, c: DecoderConfig, layers: list[nn.Module], dtype: torch.dtype,
                 norm: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = norm(c.hidden_size, c.rms_norm_eps, dtype)
        # Gemma: the embedding times sqrt(hidden_size), that factor rounded to the dtype first.
        self.embed_scale = c.hidden_size ** 0.5 if c.scale_embeddings else None
        # Speculative decoding with an EAGLE head reads hidden states of every packed row besides
        # the sampled rows' output (see `keep_hidden_states`); left unset, nothing is kept.
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.keep_final_hidden_states = False
        self.aux_hidden_states: torch.Tensor | None = None

    def keep_hidden_states(self, layers: tuple[int, ...] = (), final: bool = False) -> None:
        """See CausalLM.keep_hidden_states."""
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
        projection and MLP on those rows alone, unless `keep_hidden_states` asked for every
        row's output. An empty index gives an empty result."""
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        residual = None
        aux_layers = self.aux_hidden_state_layers
        kept: list[torch.Tensor] = []
        num_layers = len(self.layers)
        every_row = self.keep_final_hidden_states or num_layers in aux_layers
        rows = None if every_row else logits_indices  # the last layer's output rows
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                kept.append(hidden if residual is None else hidden + residual)
            last = i == num_layers - 1
            layer_rows = rows if last else None
            if isinstance(layer, DecoderLayer):
                # Its MLP may leave its output as split-K slices where an RMSNorm adds them next.
                nxt = self.norm if last else self.layers[i + 1]
                keep = (i + 1) not in aux_layers and (isinstance(nxt, RMSNorm) or (
                    isinstance(nxt, DecoderLayer) and isinstance(nxt.input_layernorm, RMSNorm)))
                hidden, residual = layer(positions, hidden, residual, layer_rows, keep)
            else:
                hidden, residual = layer(positions, hidden, residual, layer_rows)
        if num_layers in aux_layers:
            kept.append(hidden + residual)
        if kept:
            self.aux_hidden_states = kept[0] if len(kept) == 1 else torch.cat(kept, dim=-1)
        if hidden.shape[0] == 0:
            return hidden.reduced() if isinstance(hidden, SplitKPartials) else hidden
        hidden, _ = self.norm(hidden, residual)
        if self.keep_final_hidden_states:
            self.aux_hidden_states = hidden
        if rows is None and logits_indices is not None:
            return hidden[logits_indices]
        return hidden


class DecoderForCausalLM(CausalLM):
    """A family file subclasses this with its names (`architectures`, `model_types`), its
    config defaults (`config_defaults`) and, where its checkpoints differ, `packed_modules`,
    `expert_projections`, `checkpoint_renames` or `checkpoint_shards`."""

    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    lora_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                    "qkv_proj": ("qkv_proj", None), "o_proj": ("o_proj", 0),
                    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                    "gate_up_proj": ("gate_up_proj", None), "down_proj": ("down_proj", 0)}
    # What config.json leaves implicit for this family (DecoderConfig.from_hf_config).
    config_defaults: ClassVar[dict] = {}
    # One expert's checkpoint projection name -> its part of the stacked experts.
    expert_projections: ClassVar[dict[str, str]] = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    # Checkpoint name fragment -> ours, where the family's checkpoints name a module otherwise.
    checkpoint_renames: ClassVar[dict[str, str]] = {}
    # The layer and norm blocks (Gemma: norms around attention and the MLP, weights offset from one).
    decoder_layer: ClassVar[type[nn.Module]] = DecoderLayer
    norm: ClassVar[type[nn.Module]] = RMSNorm

    @classmethod
    def read_config(cls, hf_config: dict) -> DecoderConfig:
        return DecoderConfig.from_hf_config(hf_config, **cls.config_defaults)

    def __init__(self, hf_config: dict, dtype: torch.dtype,
                 linear_method: LinearMethod | None = None, max_model_len: int | None = None) -> None:
        super().__init__()
        self.config = self.adjust_config(self.read_config(hf_config), max_model_len)
        c = self.config
        layers = [self.decoder_layer(c, self.make_mlp(c, i, dtype, linear_method), dtype, linear_method, i)
                  for i in range(c.num_hidden_layers)]
        # The decoder's projections use `linear_method` (e.g. FP8); the LM head stays 16-bit.
        self.model = DecoderModel(c, layers, dtype, self.norm)
        self.lm_head = ParallelLMHead(c.vocab_size, c.hidden_size, dtype)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def adjust_config(self, c: DecoderConfig, max_model_len: int | None) -> DecoderConfig:
        """The config as served, given the engine's max_model_len (Phi-3's LongRoPE)."""
        return c

    def make_mlp(self, c: DecoderConfig, layer: int, dtype: torch.dtype,
                 linear_method: LinearMethod | None) -> nn.Module:
        if c.is_moe and layer in c.sparse_layers:
            return SparseMoeBlock(c, dtype, linear_method)
        return GatedMLP(c.hidden_size, c.intermediate_size, c.mlp_bias, dtype, linear_method, c.hidden_act)

    # ---- the engine's interface (models/interface.py) ------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, logits_indices)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcap
        if cap:  # Gemma 2: cap * tanh(logits / cap), in the logits' dtype as Hugging Face does
            logits = torch.tanh(logits / cap) * cap
        return logits

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def keep_hidden_states(self, layers: tuple[int, ...] = (), final: bool = False) -> None:
        self.model.keep_hidden_states(layers, final)

    @property
    def aux_hidden_states(self) -> torch.Tensor | None:
        return self.model.aux_hidden_states

    @aux_hidden_states.setter
    def aux_hidden_states(self, kept: torch.Tensor | None) -> None:
        self.model.aux_hidden_states = kept

    def lora_projections(self) -> Iterator[tuple[tuple[int, str], LinearBase]]:
        """Attention projections everywhere; MLP projections of dense layers only (LoRA on
        experts is not served)."""
        for index, layer in enumerate(self.model.layers):
            yield (index, "qkv_proj"), layer.self_attn.qkv_proj
            yield (index, "o_proj"), layer.self_attn.o_proj
            if isinstance(layer.mlp, GatedMLP):
                yield (index, "gate_up_proj"), layer.mlp.gate_up_proj
                yield (index, "down_proj"), layer.mlp.down_proj

    def checkpoint_name(self, name: str) -> str:
        for theirs, ours in self.checkpoint_renames.items():
            name = name.replace(theirs, ours)
        return name

    def checkpoint_target(self, name: str) -> tuple[str, object] | None:
        """Experts' tensors go into their layer's stacked weights, shard id (expert, part)."""
        match = _EXPERT_TENSOR.match(name)
        if match is None or match["proj"] not in self.expert_projections:
            return None
        part = self.expert_projections[match["proj"]]
        param = f"{match['prefix']}.{'w2' if part == 'down' else 'w13'}_weight"
        return param, (int(match["expert"]), part)
