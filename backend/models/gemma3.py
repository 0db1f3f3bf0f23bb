"""Gemma 3, text-only checkpoints (Gemma3ForCausalLM): Gemma 2's blocks without soft-capping,
with q/k head norms (offset from one, as its other norms), five windowed layers for each global
one (sliding_window_pattern, or config.json's layer_types), and windowed layers rotating with
their own base (rope_local_base_freq, or rope_parameters' sliding_attention entry)."""
from __future__ import annotations

from .decoder_config import by_layer_types
from .gemma2 import Gemma2ForCausalLM


def gemma3_windowed_layers(c: dict, layer: int) -> bool:
    """layer_types where given, else every layer but each sliding_window_pattern-th."""
    if c.get("layer_types"):
        return by_layer_types(c, layer)
    pattern = int(c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or 6)
    return (layer + 1) % pattern != 0


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    architectures = ("Gemma3ForCausalLM",)
    model_types = ("gemma3_text",)
    config_defaults = {"scale_embeddings": True, "tie_word_embeddings": True, "qk_norm": True,
                       "windowed_layers": gemma3_windowed_layers}
