"""Hugging Face's greedy `generate`, one prompt at a time: the token ids the engine must match."""
from __future__ import annotations

import torch


def hf_greedy_generate(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Exactly `max_new` greedy tokens per prompt (EOS does not stop it), without the prompt."""
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                           min_new_tokens=max_new, do_sample=False, pad_token_id=0)
        outs.append(y[0, len(ids):].tolist())
    return outs
