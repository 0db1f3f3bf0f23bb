"""How a request names its LoRA adapter. Torch-free: the Triton stub's side of the engine
checks requests with it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's name for a request's adapter. `lora_name` names it; with `lora_path` (in-process
    only: LLM, LLMEngine) an adapter the engine does not serve yet is read from that directory
    and served from then on under that name. `lora_int_id` is not used (vLLM's key for it)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


def lora_name_of(lora_request: "LoRARequest | str | None") -> str | None:
    """The adapter name of a LoRARequest, or a name as it is (None: the base model)."""
    if lora_request is None or isinstance(lora_request, str):
        return lora_request
    if isinstance(lora_request, LoRARequest):
        return lora_request.lora_name
    raise ValueError(f"lora_request must be a LoRARequest or an adapter name, got "
                     f"{type(lora_request).__name__}.")
