"""What an EAGLE draft head's directory says: its config.json read against the target model's
shape, and the checkpoint tensors (names and shapes) the published layouts hold.
docs/speculative_decoding.md ("EAGLE checkpoint layout") gives the sources of these facts."""
from __future__ import annotations

from dataclasses import dataclass, replace

from .decoder_config import DecoderConfig

EAGLE_METHODS = ("eagle", "eagle3")

# Config flags of variants whose arithmetic differs from the layouts served here.
_UNSUPPORTED_FLAGS = {
    "fc_norm": "an RMSNorm on each auxiliary hidden state before fc (SpecForge's fc_norm)",
    "add_para_norm": "HASS's norms on the embeddings and hidden states before fc",
}


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's choice when the head's config names no layers: early, middle and late."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def _aux_layer_ids(config: dict, num_target_layers: int) -> tuple[int, ...]:
    named = config.get("eagle_aux_hidden_state_layer_ids") or \
        (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = tuple(int(i) for i in named) if named else default_aux_layer_ids(num_target_layers)
    source = "eagle_aux_hidden_state_layer_ids" if named else \
        f"the default (2, L // 2, L - 3) for the target's {num_target_layers} layers"
    if len(ids) != 3 or len(set(ids)) != 3 or any(not 0 <= i <= num_target_layers for i in ids):
        raise ValueError(f"eagle head: auxiliary layers {ids} (from {source}) must be 3 distinct "
                         f"target layer ids in 0..{num_target_layers}")
    return tuple(sorted(ids))  # the target appends them in layer order


@dataclass(frozen=True)
class EagleHeadSpec:
    """An EAGLE-1 ("eagle") or EAGLE-3 ("eagle3") head for one target model."""

    method: str
    args: DecoderConfig  # the head's decoder (its vocab_size is the target's)
    draft_vocab_size: int  # rows of the head's lm_head: the target vocabulary or a subset (EAGLE-3)
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # EAGLE-3: target layers whose inputs it reads; EAGLE-1: ()
    fc_bias: bool  # EAGLE-1: its config's "bias", else whether its checkpoint has fc.bias
    norm_before_residual: bool  # EAGLE-3 variant: the residual is hidden_norm(hidden)

    @classmethod
    def from_config(cls, method: str, config: dict, target: DecoderConfig, max_model_len: int | None = None,
                    checkpoint_has_fc_bias: bool = True) -> "EagleHeadSpec":
        """checkpoint_has_fc_bias: decides EAGLE-1's fc bias where the config does not (EAGLE's
        checkpoints have one; vLLM's EAGLE-1 reads none)."""
        if method not in EAGLE_METHODS:
            raise ValueError(f"eagle head: method {method!r} is not one of {EAGLE_METHODS}")
        archs = config.get("architectures") or []
        if method == "eagle" and any("eagle3" in a.lower() for a in archs):
            raise ValueError(f"eagle head: architectures {archs} is an EAGLE-3 head; use method 'eagle3'")
        for flag, what in _UNSUPPORTED_FLAGS.items():
            if config.get(flag):
                raise ValueError(f"eagle head: {flag}=true ({what}) is not supported")
        if (config.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
            raise ValueError("eagle head: eagle_config.use_aux_hidden_state=false is not supported")
        args = DecoderConfig.from_hf_config(config)
        if args.vocab_size != target.vocab_size:
            raise ValueError(f"eagle head: vocab_size {args.vocab_size} differs from the target's "
                             f"{target.vocab_size}")
        # The head's positions are the target's: its rotary table covers the engine's lengths
        # even where its config says less (EAGLE-3 configs often say 2048).
        longest = max(args.max_position_embeddings, target.max_position_embeddings, max_model_len or 0)
        args = replace(args, max_position_embeddings=longest, tie_word_embeddings=False)
        target_hidden = int(config.get("target_hidden_size") or args.hidden_size)
        if target_hidden != target.hidden_size:
            raise ValueError(f"eagle head: it reads hidden states of size {target_hidden} "
                             f"(target_hidden_size or hidden_size), the target's are {target.hidden_size}")
        if method == "eagle3":
            if args.num_hidden_layers != 1:
                raise ValueError(f"eagle head: an EAGLE-3 head has one decoder layer (midlayer), "
                                 f"its config says num_hidden_layers={args.num_hidden_layers}")
            draft_vocab = int(config.get("draft_vocab_size") or args.vocab_size)
            if not 0 < draft_vocab <= args.vocab_size:
                raise ValueError(f"eagle head: draft_vocab_size {draft_vocab} must be in "
                                 f"1..{args.vocab_size} (the target's vocabulary)")
            return cls(method, args, draft_vocab, target_hidden,
                       _aux_layer_ids(config, target.num_hidden_layers), False,
                       bool(config.get("norm_before_residual", False)))
        if target_hidden != args.hidden_size:
            raise ValueError("eagle head: an EAGLE-1 head's hidden_size must be the target's")
        return cls(method, args, args.vocab_size, target_hidden, (),
                   bool(config.get("bias", checkpoint_has_fc_bias)), False)

    @property
    def has_vocab_map(self) -> bool:
        return self.draft_vocab_size < self.args.vocab_size

    def checkpoint_layout(self) -> tuple[dict[str, tuple[int, ...]], frozenset[str]]:
        """(every tensor name of the published layout -> its shape, the names that may be absent).
        Absent embed_tokens (and EAGLE-1's lm_head) mean the target's are shared."""
        a = self.args
        h, q, kv = a.hidden_size, a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
        shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (a.vocab_size, h)}
        optional = {"embed_tokens.weight"}
        if self.method == "eagle3":
            shapes["fc.weight"] = (h, 3 * self.target_hidden_size)
            blocks = ["midlayer."]
            shapes.update({"midlayer.hidden_norm.weight": (h,), "norm.weight": (h,),
                           "lm_head.weight": (self.draft_vocab_size, h),
                           "d2t": (self.draft_vocab_size,), "t2d": (a.vocab_size,)})
            optional.add("t2d")  # a check of d2t: nothing reads it when drafting
            if not self.has_vocab_map:
                optional.add("d2t")
        else:
            shapes["fc.weight"] = (h, 2 * h)
            if self.fc_bias:
                shapes["fc.bias"] = (h,)
            blocks = [f"layers.{i}." for i in range(a.num_hidden_layers)]
            shapes["lm_head.weight"] = (a.vocab_size, h)
            optional.add("lm_head.weight")
        attn_in = 2 * h if self.method == "eagle3" else h
        for i, p in enumerate(blocks):
            if self.method == "eagle3" or i > 0:  # EAGLE-1's first layer has no input_layernorm
                shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                shapes[f"{p}self_attn.{name}.weight"] = (rows, attn_in)
                if a.attention_bias:
                    shapes[f"{p}self_attn.{name}.bias"] = (rows,)
            shapes[p + "self_attn.o_proj.weight"] = (h, q)
            shapes[p + "mlp.gate_proj.weight"] = (a.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (a.intermediate_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, a.intermediate_size)
            if a.mlp_bias:
                for name, rows in (("gate_proj", a.intermediate_size), ("up_proj", a.intermediate_size),
                                   ("down_proj", h)):
                    shapes[f"{p}mlp.{name}.bias"] = (rows,)
        return shapes, frozenset(optional)
