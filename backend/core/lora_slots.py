"""LoRASlots: which LoRA adapters occupy the device's `max_loras` slots, for the scheduler.

Every adapter of `lora_modules` is in host memory; the device holds `max_loras` of them at a
time. A running sequence holds a reference on its adapter's slot; a slot no running sequence
uses can take another adapter (the least recently used of those first), which the model
runner copies in before the step that first uses it. So a step never mixes more than
`max_loras` adapters, and a waiting request whose adapter finds no slot waits while others go
ahead (as in vLLM). Plain Python: the scheduler's tests run it without a model.
"""
from __future__ import annotations


class LoRASlots:
    def __init__(self, num_slots: int, resident: list[str] = ()) -> None:
        """resident: the adapters already in slots 0, 1, ... (loaded with the model)."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.names: list[str | None] = list(resident)[:num_slots]
        self.names += [None] * (num_slots - len(self.names))
        self.refs = [0] * num_slots  # running sequences using each slot
        self._last_used = [0] * num_slots
        self._clock = 0
        self._loads: list[tuple[int, str]] = []  # (slot, adapter) to copy in before the step
        self.num_loads = 0

    def can_use(self, name: str) -> bool:
        return name in self.names or 0 in self.refs

    def acquire(self, name: str) -> int:
        """A slot holding `name` for one more running sequence (can_use must hold)."""
        if name in self.names:
            slot = self.names.index(name)
        else:
            free = [i for i, r in enumerate(self.refs) if r == 0]
            if not free:
                raise RuntimeError(f"no LoRA slot is free for adapter {name!r}")
            # An empty slot first, then the one unused for longest.
            slot = min(free, key=lambda i: (self.names[i] is not None, self._last_used[i]))
            self.names[slot] = name
            self._loads.append((slot, name))
            self.num_loads += 1
        self.refs[slot] += 1
        self._clock += 1
        self._last_used[slot] = self._clock
        return slot

    def release(self, slot: int) -> None:
        if self.refs[slot] <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        self.refs[slot] -= 1

    def take_loads(self) -> list[tuple[int, str]]:
        """Slots given a new adapter since the last call; only the last load of a slot counts."""
        loads, self._loads = self._loads, []
        last = {slot: name for slot, name in loads}
        return sorted(last.items())
