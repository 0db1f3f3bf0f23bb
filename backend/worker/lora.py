"""Multi-LoRA serving: PEFT adapters loaded next to the base model, each request choosing one
by name (`lora_name`, as Triton's vLLM backend takes it), requests of different adapters in
one batch.

Every listed adapter is read at start-up: for each decoder projection that some adapter
targets (every projection when none is listed), the device holds `max_loras` slots of stacked
A and B matrices ([S, R, K] and [S, N, R], the scaling folded into B) and the layer adds, for
each row of a step, the delta of its row's adapter (`kernels/lora.py`; rows without one get
nothing). The fused projections hold their parts side by side: q, k and v (or gate and up)
each own R of the stacked ranks and their own rows of B, so an adapter that targets only
q_proj leaves k and v alone. By default there is one slot per listed adapter; with fewer,
adapters take turns: the scheduler gives a slot to an adapter when a request needs it and no
running sequence uses the slot's adapter (`backend/core/lora_slots.py`), and the manager copies it
in from host memory, which keeps `max_cpu_loras` adapters (by default all) and reads a dropped
one from its directory again. In-process, a request may bring an adapter the engine does not
serve yet (vLLM's `LoRARequest(name, id, path)`).
"""
from __future__ import annotations

import json
import math
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from ..layers.linear import LinearBase

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class LoRAAdapter:
    """One PEFT adapter directory (adapter_config.json + adapter_model.safetensors): its
    scaling, and for each (layer, checkpoint module) its A [r, in] and B [out, r]."""

    def __init__(self, name: str, path: str, num_layers: int, max_lora_rank: int,
                 targets: dict[str, tuple[str, int | None]]) -> None:
        """targets: the module names the model lets adapters target (`CausalLM.lora_modules`)."""
        self.name, self.path = name, path
        config_path = os.path.join(path, "adapter_config.json")
        weights_path = os.path.join(path, "adapter_model.safetensors")
        for needed in (config_path, weights_path):
            if not os.path.isfile(needed):
                raise ValueError(f"LoRA adapter {name!r}: {path!r} has no {os.path.basename(needed)}.")
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
        self.rank = config.get("r")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA adapter {name!r}: r must be a positive integer, got {self.rank!r}.")
        if self.rank > max_lora_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {self.rank}, more than max_lora_rank="
                             f"{max_lora_rank}; raise max_lora_rank.")
        refused = {"use_dora": "DoRA", "modules_to_save": "modules_to_save",
                   "rank_pattern": "rank_pattern", "alpha_pattern": "alpha_pattern",
                   "fan_in_fan_out": "fan_in_fan_out"}
        for key, what in refused.items():
            if config.get(key):
                raise ValueError(f"LoRA adapter {name!r}: {what} is not supported.")
        if config.get("bias", "none") != "none":
            raise ValueError(f"LoRA adapter {name!r}: bias {config['bias']!r} is not supported "
                             f"(adapters without biases are).")
        alpha = config.get("lora_alpha", self.rank)
        self.scaling = alpha / (math.sqrt(self.rank) if config.get("use_rslora") else self.rank)
        self.weights: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        with safe_open(weights_path, framework="pt") as f:
            for key in f.keys():
                if ".experts." in key:
                    raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} targets an expert of a "
                                     f"mixture-of-experts layer; LoRA on experts is not supported "
                                     f"(on attention and dense MLP projections it is).")
                match = _KEY.search(key)
                if match is None or match.group(2) not in targets:
                    raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight "
                                     f"of a supported projection ({', '.join(targets)}).")
                layer = int(match.group(1))
                if layer >= num_layers:
                    raise ValueError(f"LoRA adapter {name!r}: {key!r} names layer {layer}, but the "
                                     f"model has {num_layers}.")
                self.weights.setdefault((layer, match.group(2)), {})[match.group(3)] = f.get_tensor(key)
        for (layer, module), pair in self.weights.items():
            if set(pair) != {"A", "B"}:
                raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_{''.join(pair)} "
                                 f"without lora_{'B' if 'A' in pair else 'A'}.")
            a, b = pair["A"], pair["B"]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != self.rank or b.shape[1] != self.rank:
                raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_A "
                                 f"{tuple(a.shape)} and lora_B {tuple(b.shape)}, not [r, in] and "
                                 f"[out, r] with r={self.rank}.")
        if not self.weights:
            raise ValueError(f"LoRA adapter {name!r}: {weights_path!r} holds no LoRA weights.")


@dataclass
class LoRAWeights:
    """One projection's stacked adapters, as kernels/lora.py takes them."""

    a: torch.Tensor  # [S, parts * R, in]
    b: torch.Tensor  # [S, out, parts * R], scaling folded in


class LoRAManager:
    """Attaches the device's stacked slots (`LinearBase.lora`, `num_slots` = `max_loras`) to each
    projection that an adapter may target, keeps adapters ready in host memory (at most
    `max_cpu_loras` of them, the least recently used dropped first; a dropped one is read from
    its directory again when it next takes a slot), and copies an adapter into a slot when the
    scheduler gives it one (`load`). Adapters come from `lora_modules` at start-up, and later
    from requests that bring their own directory (`add_adapter`, vLLM's
    `LoRARequest(name, id, path)`)."""

    def __init__(self, model: nn.Module, modules: dict[str, str] | None, max_loras: int | None,
                 max_lora_rank: int, dtype: torch.dtype, device: torch.device,
                 max_cpu_loras: int | None = None) -> None:
        modules = modules or {}
        self._model = model
        self._parts = model.lora_modules  # adapter module -> (our projection, its part)
        self._num_layers = len(model.attention_layers())
        self.rank = max_lora_rank
        self.dtype = dtype
        # Listed adapters: one slot each unless max_loras says otherwise; none listed: vLLM's 1.
        self.num_slots = max_loras or max(1, len(modules))
        self.max_cpu_loras = max_cpu_loras
        self._pin = device.type == "cuda"  # host copies the device takes without waiting
        self.paths: dict[str, str] = {}  # every adapter the engine can serve -> its directory
        self.disk_reads = 0  # adapters read from their directory (start-up included)
        # Requests may add adapters from other threads (StreamingEngine.add_request) while the
        # step loop loads them: the cache's bookkeeping is under this lock, disk reads are not.
        self._lock = threading.Lock()
        # Each projection's input features and its parts' output rows, to check adapters against
        # (the whole projection's: with tensor parallelism each rank keeps its shard of them).
        self._shapes = {key: linear.full_lora_shape for key, linear in model.lora_projections()}
        # Every listed adapter is read and checked now; only those host memory keeps (the first
        # max_cpu_loras) stay read, so start-up holds no more than that at once.
        keep = len(modules) if max_cpu_loras is None else max_cpu_loras
        adapters, targets = [], set()
        for i, (name, path) in enumerate(modules.items()):
            ad = self._read(name, path)
            targets |= {(layer, self._parts[module][0]) for layer, module in ad.weights}
            self.paths[name] = ad.path
            if i < keep:
                adapters.append(ad)  # checked as it is stacked below (`_stack_all`)
            else:
                self._check_shapes(ad)
        # Slots on the projections the listed adapters target (no kernel work on the others);
        # with none listed, on every projection, for adapters that requests bring.
        self._slots: list[tuple[int, str, LinearBase, list[int]]] = []  # (layer, proj, linear, part rows)
        for (index, proj), linear in model.lora_projections():
            if modules and (index, proj) not in targets:
                continue
            in_features, rows = linear.in_features, linear.part_sizes
            parts = len(rows)
            shape_a, shape_b = (parts * self.rank, in_features), (sum(rows), parts * self.rank)
            linear.lora = LoRAWeights(torch.zeros(self.num_slots, *shape_a, dtype=dtype, device=device),
                                      torch.zeros(self.num_slots, *shape_b, dtype=dtype, device=device))
            self._slots.append((index, proj, linear, rows))
        # adapter -> its (A, B) per slotted projection (None where it has none), most recent last
        self._host: OrderedDict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = OrderedDict()
        for ad in reversed(adapters):  # the first ones (loaded into slots next) stay most recent
            self._keep(ad, self._stack_all(ad))
        self.resident = list(modules)[:self.num_slots]
        for slot, name in enumerate(self.resident):
            self.load(slot, name)

    def add_adapter(self, name: str, path: str) -> None:
        """Serve one more adapter (read and checked now; ValueError says what is wrong). A
        name already served must come with its own directory."""
        if self._served_from(name, path):
            return
        ad = self._read(name, path)
        pairs = self._stack_all(ad)
        with self._lock:
            if not self._served_from(name, path):  # another thread may have added it meanwhile
                self._keep(ad, pairs)

    def _served_from(self, name: str, path: str) -> bool:
        """True if `name` is served from `path`, False if not served; ValueError for another path."""
        known = self.paths.get(name)
        if known is None:
            return False
        if os.path.realpath(known) != os.path.realpath(path):
            raise ValueError(f"LoRA adapter {name!r} is already served from {known!r}; "
                             f"another adapter needs another name (got {path!r}).")
        return True

    def load(self, slot: int, name: str) -> None:
        """Put adapter `name` in `slot`, queued on the device after the steps already launched
        (no running sequence uses the slot's previous adapter). An adapter no longer in host
        memory is read from its directory first (the step waits for the read)."""
        with self._lock:
            pairs = self._host.get(name)
            if pairs is not None:
                self._host.move_to_end(name)
        if pairs is None:
            ad = self._read(name, self.paths[name])
            pairs = self._stack_all(ad)
            with self._lock:
                self._keep(ad, pairs)
        for (_, _, linear, _), pair in zip(self._slots, pairs):
            if pair is None:
                linear.lora.a[slot].zero_()
                linear.lora.b[slot].zero_()
            else:
                # Pinned sources: the copy runs in order on the stream, and the host allocator
                # keeps the memory until it has, even if the adapter leaves the cache meanwhile.
                linear.lora.a[slot].copy_(pair[0], non_blocking=True)
                linear.lora.b[slot].copy_(pair[1], non_blocking=True)

    @property
    def host_adapters(self) -> list[str]:
        """The adapters in host memory, least recently used first."""
        return list(self._host)

    def _read(self, name: str, path: str) -> LoRAAdapter:
        ad = LoRAAdapter(name, path, self._num_layers, self.rank, self._parts)
        with self._lock:
            self.disk_reads += 1
        return ad

    def _keep(self, ad: LoRAAdapter, pairs: list) -> None:
        """Serve the adapter from now on, its stacked pairs in host memory (dropping the least
        recently used beyond max_cpu_loras). Called with the lock held (or before any thread)."""
        self.paths.setdefault(ad.name, ad.path)
        self._host[ad.name] = pairs
        self._host.move_to_end(ad.name)
        while self.max_cpu_loras is not None and len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def _stack_all(self, ad: LoRAAdapter) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """The adapter's (A, B) for each slotted projection, pinned on CUDA (None where it has
        none); ValueError if it targets a projection without slots or has the wrong shapes."""
        self._check_shapes(ad)
        slotted = {(index, proj) for index, proj, _, _ in self._slots}
        missing = sorted({f"layer {layer} {module}" for layer, module in ad.weights
                          if (layer, self._parts[module][0]) not in slotted})
        if missing:
            raise ValueError(f"LoRA adapter {ad.name!r} targets {', '.join(missing[:4])}"
                             f"{', ...' if len(missing) > 4 else ''}, which no adapter listed at "
                             f"start-up targets; list one that does in lora_modules (or list none, "
                             f"so that every projection takes adapters).")
        pairs = []
        for index, proj, linear, rows in self._slots:
            pair = self._stack(ad, index, proj, rows, linear)
            pairs.append(None if pair is None else tuple(t.pin_memory() if self._pin else t for t in pair))
        return pairs

    def _check_shapes(self, ad: LoRAAdapter) -> None:
        for (layer, module), pair in ad.weights.items():
            proj, part = self._parts[module]
            in_features, rows = self._shapes[(layer, proj)]
            count = sum(rows) if part is None else rows[part]
            if pair["A"].shape[1] != in_features or pair["B"].shape[0] != count:
                raise ValueError(
                    f"LoRA adapter {ad.name!r}: layer {layer} {module} maps {pair['A'].shape[1]} "
                    f"-> {pair['B'].shape[0]} features, but the model's maps {in_features} -> {count}.")

    def _stack(self, ad: LoRAAdapter, index: int, proj: str, rows: list[int],
               linear: LinearBase) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The adapter's A and B for one projection in the slot layout (this tensor-parallel
        rank's shard), or None if it has none."""
        r, parts, out_features, in_features = self.rank, len(rows), sum(rows), linear.in_features
        a = b = None
        for (layer, module), pair in ad.weights.items():
            if layer != index or self._parts[module][0] != proj:
                continue
            if a is None:
                a = torch.zeros(parts * r, in_features, dtype=self.dtype)
                b = torch.zeros(out_features, parts * r, dtype=self.dtype)
            part = self._parts[module][1]
            first, count = (0, out_features) if part is None else (sum(rows[:part]), rows[part])
            col = (part or 0) * r
            a_shard, b_shard = linear.shard_lora(pair["A"], pair["B"], part)
            a[col:col + ad.rank] = a_shard.to(self.dtype)
            b[first:first + count, col:col + ad.rank] = (b_shard.float() * ad.scaling).to(self.dtype)
        return None if a is None else (a, b)
