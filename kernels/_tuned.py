"""What the kernels' measured tables (kernels/configs/*.json) share: reading one into config
objects, and the name a device's entries are kept under. Plain Python and torch (no Triton)."""

from __future__ import annotations

import functools
import json
import os
from typing import Callable, TypeVar

import torch

C = TypeVar("C")


@functools.lru_cache(maxsize=None)
def load_table(path: str, cls: type[C], check: Callable[[str, C], None] | None = None) -> dict[str, dict[str, C]]:
    """{GPU name: {key: cls(**entry)}} from the table's "configs", each config passed to
    check(key, config) if given; empty when there is no file. An entry that cannot be taken is
    a ValueError naming the file, the GPU and the key."""
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        table = json.load(f)
    out: dict[str, dict[str, C]] = {}
    for gpu, entries in table.get("configs", {}).items():
        out[gpu] = {}
        for key, entry in entries.items():
            try:
                out[gpu][key] = cls(**entry)
                if check is not None:
                    check(key, out[gpu][key])
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}: {gpu} {key}: {e}") from None
    return out


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    """The GPU model's name for a CUDA device (the tables' keys), else the device type."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
