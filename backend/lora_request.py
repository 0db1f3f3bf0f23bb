"""How a request names its LoRA adapter. Torch-free: the Triton stub's side of the engine
checks requests with it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's name for a request's adapter. Only `lora_name` is read: the adapter must be one
    the engine was started with (`lora_modules`)."""

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
