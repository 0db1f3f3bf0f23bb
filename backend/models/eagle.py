"""EAGLE-1 and EAGLE-3 draft heads (speculative_config method "eagle" / "eagle3"), in the
published checkpoint layouts (docs/speculative_decoding.md, "EAGLE checkpoint layout").

A head drafts from the target's hidden states: row t pairs the target's hidden state at position t
with the token at t + 1 and predicts the token at t + 2, at position t (vLLM v1's token shift).
Its attention is the project's paged attention, over a KV cache of its own, under the same
attention metadata as the target's step."""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from ..layers.attention import Attention
from ..layers.attention_block import SelfAttention
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.layernorm import RMSNorm
from ..layers.linear import QKVParallelLinear, ReplicatedLinear
from ..layers.mlp import GatedMLP
from .decoder import DecoderForCausalLM, DecoderLayer
from .decoder_config import DecoderConfig
from .eagle_config import EagleHeadSpec
from .interface import CausalLM
from .loader import checkpoint_tensor_shapes, load_safetensors


class Eagle3DecoderLayer(nn.Module):
    """EAGLE-3's midlayer: attention over cat(input_layernorm(embeds), hidden_norm(hidden)), 2H
    wide; the un-normed hidden state is the residual."""

    def __init__(self, spec: EagleHeadSpec, dtype: torch.dtype) -> None:
        super().__init__()
        a = spec.args
        self.norm_before_residual = spec.norm_before_residual
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.self_attn = SelfAttention(a, dtype)
        self.self_attn.qkv_proj = QKVParallelLinear(2 * a.hidden_size, a.head_dim, a.num_attention_heads,
                                                    a.num_key_value_heads, bias=a.attention_bias, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.mlp = GatedMLP(a.hidden_size, a.intermediate_size, a.mlp_bias, dtype)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual): their sum is the layer's output."""
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


@dataclass(frozen=True)
class SharedWeights:
    """Which of the head's embedding and LM head came from its checkpoint (else: the target's)."""

    own_embed_tokens: bool
    own_lm_head: bool


class EagleDraftHead(nn.Module):
    """A draft head's module tree names its parameters as the checkpoint does (packed q/k/v and
    gate/up aside), so the target's loader reads it.

    Per draft step the caller runs, under one `set_attention_metadata(...)`:
    `forward(input_ids, positions, hidden)` -> (hidden for the next step, normed hidden), then
    `compute_logits(normed)` over the draft vocabulary, argmax, and `draft_to_target`."""

    packed_modules = DecoderForCausalLM.packed_modules

    def __init__(self, method: str, config: dict, target: DecoderConfig, dtype: torch.dtype,
                 max_model_len: int | None = None, checkpoint_has_fc_bias: bool = True) -> None:
        super().__init__()
        self.spec = EagleHeadSpec.from_config(method, config, target, max_model_len, checkpoint_has_fc_bias)
        self.method = method
        a = self.args = self.spec.args
        self.aux_layer_ids: tuple[int, ...] = self.spec.aux_layer_ids
        self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, dtype)
        if method == "eagle3":
            self.fc = ReplicatedLinear(3 * self.spec.target_hidden_size, a.hidden_size, False, dtype)
            self.midlayer = Eagle3DecoderLayer(self.spec, dtype)
            self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        else:
            self.fc = ReplicatedLinear(2 * a.hidden_size, a.hidden_size, self.spec.fc_bias, dtype)
            self.layers = nn.ModuleList([
                DecoderLayer(a, GatedMLP(a.hidden_size, a.intermediate_size, a.mlp_bias, dtype), dtype)
                for _ in range(a.num_hidden_layers)])
            self.layers[0].input_layernorm = nn.Identity()  # fc's output goes in un-normed
        self.lm_head = ParallelLMHead(self.spec.draft_vocab_size, a.hidden_size, dtype)
        # Draft token d is target token d + d2t[d]; t2d marks the target tokens the head can draft.
        self.register_buffer("d2t", torch.zeros(self.spec.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(a.vocab_size, dtype=torch.bool))
        self.own_weights: frozenset[str] = frozenset()  # checkpoint tensors loaded (load_weights)

    @classmethod
    def from_pretrained(cls, method: str, head_dir: str, target: CausalLM, dtype: torch.dtype,
                        max_model_len: int | None = None) -> "EagleDraftHead":
        """The head of `head_dir` (config.json + safetensors), loaded, sharing what it lacks with
        `target`. Build it on the target's device (a `torch.device` context)."""
        if not glob.glob(os.path.join(head_dir, "*.safetensors")):
            raise ValueError(f"eagle head: {head_dir!r} has no *.safetensors file (a head saved as "
                             f"pytorch_model.bin converts with safetensors.torch.save_file)")
        with open(os.path.join(head_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        has_fc_bias = "fc.bias" in checkpoint_tensor_shapes(head_dir)
        head = cls(method, config, target.config, dtype, max_model_len, has_fc_bias)
        head.eval()
        head.load_weights(head_dir)
        head.share_target_weights(target)
        return head

    # ---- weights --------------------------------------------------------------------------------
    def load_weights(self, head_dir: str) -> None:
        """Checks every tensor's name and shape against the layout, then loads them."""
        shapes, optional = self.spec.checkpoint_layout()
        found = checkpoint_tensor_shapes(head_dir)
        kind = "EAGLE-3" if self.method == "eagle3" else "EAGLE-1"
        for name in found:
            if name not in shapes:
                raise ValueError(f"eagle head: checkpoint tensor {name!r} is not part of the {kind} layout")
        for name, shape in shapes.items():
            if name not in found and name not in optional:
                raise ValueError(f"eagle head: checkpoint {head_dir!r} lacks tensor {name!r} "
                                 f"(shape {shape}) of the {kind} layout")
            if name in found and found[name] != shape:
                raise ValueError(f"eagle head: tensor {name!r} has shape {found[name]}, expected {shape}")
        buffers = tuple(b for b in ("d2t", "t2d") if b in found)
        load_safetensors(self, head_dir, buffers=buffers, optional=optional)
        if "d2t" in found:
            self._check_vocab_map("t2d" in found)
        self.own_weights = frozenset(found)

    def _check_vocab_map(self, has_t2d: bool) -> None:
        target_ids = self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)
        if bool(((target_ids < 0) | (target_ids >= self.args.vocab_size)).any()):
            raise ValueError(f"eagle head: d2t maps draft tokens outside the target's "
                             f"{self.args.vocab_size} tokens")
        if has_t2d and not torch.equal(self.t2d.nonzero().flatten(), target_ids.sort().values):
            raise ValueError("eagle head: t2d does not mark exactly the target tokens d2t maps to")

    def share_target_weights(self, target: CausalLM) -> SharedWeights:
        """Points the embedding (and EAGLE-1's LM head) at the target's where the checkpoint had
        none, as vLLM does; an embedding of another width cannot be shared."""
        shared = SharedWeights("embed_tokens.weight" in self.own_weights, "lm_head.weight" in self.own_weights)
        if not shared.own_embed_tokens:
            self.embed_tokens.weight = self._shareable("embed_tokens.weight",
                                                      target.get_parameter("model.embed_tokens.weight"))
        if not shared.own_lm_head:
            if self.method == "eagle3":
                raise ValueError("eagle head: an EAGLE-3 head has its own lm_head (checkpoint lacks it)")
            self.lm_head.weight = self._shareable("lm_head.weight", target.get_parameter("lm_head.weight"))
        return shared

    def _shareable(self, name: str, target_weight: nn.Parameter) -> nn.Parameter:
        own = dict(self.named_parameters())[name]
        if own.shape != target_weight.shape:
            raise ValueError(f"eagle head: the checkpoint lacks {name} and the target's is "
                             f"{tuple(target_weight.shape)}, the head needs {tuple(own.shape)}")
        return target_weight

    # ---- drafting -------------------------------------------------------------------------------
    def combine_hidden_states(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states ([T, 3 * H_target]: its auxiliary layers' in layer order, for
        EAGLE-3; [T, H]: its final normed ones, for EAGLE-1) as the head's input [T, H]."""
        return self.fc(target_hidden) if self.method == "eagle3" else target_hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden state for the next draft step, normed hidden state for the logits), every row.
        EAGLE-3: the midlayer's output before the final norm, and after it. EAGLE-1 has no final
        norm (it predicts the target's normed features): both are its layers' output."""
        embeds = self.embed_tokens(input_ids)
        if self.method == "eagle3":
            x, residual = self.midlayer(positions, embeds, hidden)
            normed, prenorm = self.norm(x, residual)
            return prenorm, normed
        x, residual = self.fc(torch.cat([embeds, hidden], dim=-1)), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        out = x + residual
        return out, out

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[T, draft_vocab_size] logits."""
        return self.lm_head(normed)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary ids (the same ids without a vocabulary map)."""
        return ids + self.d2t[ids] if self.spec.has_vocab_map else ids

    def attention_layers(self) -> list[Attention]:
        layers = [self.midlayer] if self.method == "eagle3" else list(self.layers)
        return [layer.self_attn.attn for layer in layers]

    def request_target_hidden_states(self, target: CausalLM) -> None:
        """Makes the target keep, every forward, the hidden states this head reads
        (`target.aux_hidden_states`)."""
        target.keep_hidden_states(self.aux_layer_ids, final=self.method == "eagle")
