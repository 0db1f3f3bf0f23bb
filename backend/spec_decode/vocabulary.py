"""The check that a draft model shares the target's vocabulary, made by the engine before the
worker loads the draft (its proposals are target token ids). EAGLE heads map their own
vocabulary to the target's (backend/models/eagle.py), so they are not checked here."""
from __future__ import annotations

import os

from ..engine.tokenizer import load_tokenizer
from ..engine_config import SpeculativeConfig

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def check_draft_vocabulary(spec: SpeculativeConfig | None, tokenizer, target_hf_config: dict) -> None:
    """A draft model's token ids must mean the target's: its tokenizer (when its directory has
    one) must have the target's vocabulary, else its config the target's vocab_size. (A padded
    embedding may be larger than the tokenizer, as Qwen2.5's sizes differ: only the target's ids
    are proposed.)"""
    if spec is None or not spec.uses_draft_model or spec.is_eagle:
        return
    path = spec.draft_model_config.model
    if any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        draft, target = load_tokenizer(path).get_vocab(), tokenizer.get_vocab()
        # Tokenizer classes add special tokens of their own (Qwen2's <|endoftext|>): extra tokens
        # on either side are fine, a token the two number differently is not.
        differ = sorted(t for t, i in target.items() if t in draft and draft[t] != i)
        missing = sorted(t for t in target if t not in draft)
        if differ or len(missing) > len(target) // 100:
            raise ValueError(f"speculative_config: the draft model's tokenizer ({path}) numbers its tokens "
                             f"otherwise than the target's ({len(differ)} tokens with other ids, "
                             f"{len(missing)} missing); a draft model must use the target's vocabulary.")
        return
    draft_vocab = spec.draft_model_config.hf_config.get("vocab_size")
    if draft_vocab != target_hf_config.get("vocab_size"):
        raise ValueError(f"speculative_config: the draft model's vocab_size ({draft_vocab}) is not the "
                         f"target's ({target_hf_config.get('vocab_size')}) and its directory has no tokenizer "
                         f"to compare; a draft model must use the target's vocabulary.")
