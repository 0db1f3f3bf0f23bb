"""vLLM's request fields that this server does not implement. A request that sets one to anything
but its no-op value gets a 400 naming it: accepting it and generating without it would answer a
different question than the one asked. OpenAI's own fields that change nothing here (user,
metadata, store, ...) are still accepted and ignored, as vLLM and OpenAI clients expect."""
from __future__ import annotations

from typing import Any

from tritium.frontend.errors import OpenAIError, bad_request

# Field -> the values that leave the request unchanged (vLLM's defaults, or "off").
_BOTH: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),  # beam search's
    "watermarking": (None, False),
    "logprob_token_ids": (None,),
    "logits_processors": (None, []),
    "guided_whitespace_pattern": (None,),
    "return_token_ids": (None, False),
    "return_token_offsets": (None, False),  # the render endpoints'
    "return_mm_kwargs": (None, True),  # the render endpoints'
    "routed_experts_prompt_start": (None, 0),
    "session_id": (None,),
    "ec_transfer_params": (None, {}),
    "vllm_xargs": (None, {}),
    "repetition_detection": (None,),
    "thinking_token_budget": (None, -1),  # -1: unlimited
    "stream_interval": (None, 1),  # every token, as this server streams
}
CHAT_REFUSED: dict[str, tuple[Any, ...]] = {
    **_BOTH,
    "chat_template": (None,),  # vLLM too refuses it without --trust-request-chat-template
    "structural_tag": (None,),
    "media_io_kwargs": (None, {}),
    "mm_processor_kwargs": (None, {}),
    "return_prompt_text": (None, False),
}
COMPLETION_REFUSED: dict[str, tuple[Any, ...]] = {
    **_BOTH,
    "suffix": (None,),  # OpenAI's, for models trained to fill in the middle
    "prompt_embeds": (None,),
}


def refuse_unsupported(body: dict[str, Any], refused: dict[str, tuple[Any, ...]]) -> None:
    """A 400 naming the first field of `refused` that `body` sets to a value with an effect."""
    for name, no_op in refused.items():
        if name in body and not any(_same(body[name], v) for v in no_op):
            raise unsupported(name)


def unsupported(name: str) -> OpenAIError:
    return bad_request(f"{name} is not supported by this server", name)


def _same(value: Any, no_op: Any) -> bool:
    # JSON's true is not 1, nor false 0, though Python's == says so.
    return value == no_op and isinstance(value, bool) == isinstance(no_op, bool)
