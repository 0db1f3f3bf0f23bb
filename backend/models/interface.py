"""What a model architecture provides to the engine: the contract of `models/` classes.

A family is a subclass of `CausalLM` (in practice of models/decoder.py's DecoderForCausalLM)
that sets the class attributes below and implements the methods; `models/__init__.py` lists it
in `MODEL_CLASSES`. What the rest of the engine uses of a model, all of it:
- the registry reads `architectures` and `model_types`; `model_limits` calls `read_config`;
- the model builder constructs it as `cls(hf_config, dtype, linear_method, max_model_len=...)`
  and runs each module's `process_weights_after_loading` (layers/quantization.py);
- the worker, runner and CUDA graphs call `forward`, `compute_logits` and `attention_layers`,
  read `config` (head_dim, hidden_size, vocab_size, kv_window), and find the attention blocks a
  checkpoint's KV-cache scales name as modules with an `attn` (`named_modules`);
- the loader calls `named_parameters`, `named_buffers`, `checkpoint_name`, `checkpoint_target`
  and `checkpoint_shards` and reads `packed_modules` and `config.tie_word_embeddings`;
- the LoRA manager reads `lora_modules` and calls `lora_projections` and `attention_layers`;
- a draft model reads the target's `config.vocab_size`; EAGLE heads read `config`, call
  `keep_hidden_states`, read `aux_hidden_states` (which the CUDA graphs set to their buffer
  after a replay) and share the parameters named `model.embed_tokens.weight` and
  `lm_head.weight` where their checkpoint lacks them.
"""
from __future__ import annotations

from typing import ClassVar, Iterator

import torch
from torch import nn

from ..layers.attention import Attention
from ..layers.linear import LinearBase
from .decoder_config import DecoderConfig


class CausalLM(nn.Module):
    # Hugging Face `architectures` names this class serves, and config.json `model_type` values
    # (for a config that names no architecture).
    architectures: ClassVar[tuple[str, ...]] = ()
    model_types: ClassVar[tuple[str, ...]] = ()
    # Checkpoint name fragment -> (fused parameter fragment, shard id): checkpoints keep q/k/v
    # and gate/up apart; the model fuses them.
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {}
    # LoRA: the module names a PEFT adapter may target -> (the model's projection, which of its
    # parts; None: the whole projection, for checkpoints that fuse it themselves).
    lora_modules: ClassVar[dict[str, tuple[str, int | None]]] = {}
    # The model as served: sizes, heads, experts (set by __init__).
    config: DecoderConfig
    # With keep_hidden_states: the hidden states the last forward kept, [T, width].
    aux_hidden_states: torch.Tensor | None = None

    @classmethod
    def read_config(cls, hf_config: dict) -> DecoderConfig:
        """config.json as this family reads it (before the engine's max_model_len applies)."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states of the packed tokens (of the rows `logits_indices` names, if given),
        with the step's attention metadata set around the call (layers/forward_context.py)."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def attention_layers(self) -> list[Attention]:
        """Every layer's paged attention, in order: the runner binds the KV cache to them."""
        raise NotImplementedError

    def keep_hidden_states(self, layers: tuple[int, ...] = (), final: bool = False) -> None:
        """From the next forward on, `aux_hidden_states` holds every packed row's hidden states:
        with `layers` (EAGLE-3), the input of each of those decoder layers (the residual stream
        before layer i runs, Hugging Face's hidden_states[i]; i == num_hidden_layers: the last
        layer's output before the final norm), concatenated in layer order, [T, len(layers) * H];
        with `final` (EAGLE-1), the final normed hidden states, [T, H]."""
        raise NotImplementedError

    def lora_projections(self) -> Iterator[tuple[tuple[int, str], LinearBase]]:
        """((layer index, projection name), layer) of each projection LoRA adapters may target."""
        raise NotImplementedError

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name in this module tree (where the family names a module
        otherwise, e.g. Mixtral's block_sparse_moe)."""
        return name

    def checkpoint_target(self, name: str) -> tuple[str, object] | None:
        """(parameter, shard id) for a tensor stacked into a bigger parameter (one expert's
        projection into its layer's experts), else None."""
        return None

    def checkpoint_shards(self, param_name: str) -> list[tuple[str | int, int]] | None:
        """For a checkpoint tensor that is already fused: (shard id, rows) of its parts."""
        return None
