"""What a model architecture provides to the engine: the contract of `models/` classes.

A new architecture is a subclass of `CausalLM` that sets the class attributes below and
implements the methods; `models/__init__.py` lists it in `MODEL_CLASSES`. The engine reads
nothing else of a model: the runner calls `forward`, `compute_logits` and `attention_layers`,
the loader `named_parameters`, `packed_modules` and `checkpoint_shards`, the LoRA manager
`lora_modules` and `lora_projections`.
"""
from __future__ import annotations

from typing import ClassVar, Iterator

import torch
from torch import nn

from ..layers.attention import Attention
from ..layers.linear import LinearBase


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

    def lora_projections(self) -> Iterator[tuple[tuple[int, str], LinearBase]]:
        """((layer index, projection name), layer) of each projection LoRA adapters may target."""
        raise NotImplementedError

    def checkpoint_shards(self, param_name: str) -> list[tuple[str | int, int]] | None:
        """For a checkpoint tensor that is already fused: (shard id, rows) of its parts."""
        return None
