"""Linear layers in the Megatron style: each holds its tensor-parallel shard, and each parameter
has a `weight_loader` that cuts its shard out of a checkpoint tensor. How the weight is stored
and multiplied is a `LinearMethod`, so quantized formats plug in without touching models."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tritium import kernels

from .forward_context import get_lora_mapping
from .parallel_state import get_tp_rank, get_tp_size, tp_all_gather_last_dim, tp_all_reduce


# A LinearMethod's `input_quantization` when it can take its input quantized per token to FP8
# (backend/layers/quantization.py's Fp8Activation), so the kernel before it may quantize.
FP8_PER_TOKEN = "fp8_per_token"


class LinearMethod:
    """Creates a layer's weights and applies them. Subclass for quantized formats."""

    input_quantization: str | None = None  # None: the input is the activation itself
    keeps_partials = False  # apply(..., keep_partials=True) may return SplitKPartials

    def create_weights(self, layer: "LinearBase", in_features: int, out_features: int,
                       dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                    requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader

    def apply(self, layer: "LinearBase", x: torch.Tensor, bias: torch.Tensor | None,
              keep_partials: bool = False) -> torch.Tensor:
        """x @ W^T (+ bias). keep_partials: a matmul that splits K may return its slices unsummed
        (SplitKPartials), for methods that declare `keeps_partials`; bias is then None."""
        return F.linear(x, layer.weight, bias)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 tp_dim: int | None, linear_method: LinearMethod | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.tp_dim = tp_dim  # which weight dim is sharded: 0 rows (column parallel), 1 cols
        self.in_features, self.out_features = in_features, out_features  # this rank's shard
        self.lora = None  # LoRAWeights when LoRA adapters target this projection (backend/worker/lora.py)
        self.linear_method = linear_method or LinearMethod()
        self.linear_method.create_weights(self, in_features, out_features, dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    @property
    def part_sizes(self) -> list[int]:
        """Output rows of each part of a fused projection (one part when not fused)."""
        return [self.out_features]

    @property
    def full_lora_shape(self) -> tuple[int, list[int]]:
        """Input features and part rows of the whole (unsharded) projection, as adapters have them."""
        return self.in_features, self.part_sizes

    def shard_lora(self, a: torch.Tensor, b: torch.Tensor,
                   part: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's piece of an adapter's A [r, in] and B [rows of `part` (None: all), r]."""
        return a, b

    def _shard(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        dim = self.tp_dim
        # Nothing to cut when the tensor already has the shard's size along `dim` (one rank, or
        # a per-row scale [N, 1] of a row-parallel layer, whose rows are not split).
        if dim is None or dim >= loaded.dim() or loaded.shape[dim] == param.shape[dim]:
            return loaded
        size = param.shape[dim]
        return loaded.narrow(dim, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        loaded = self._shard(param, loaded)
        if param.shape != loaded.shape:
            raise ValueError(f"weight shape {tuple(loaded.shape)} does not match {tuple(param.shape)}")
        param.data.copy_(loaded)

    @property
    def takes_fp8_activation(self) -> bool:
        """Whether this layer may be given its input already quantized per token to FP8: its
        method takes it so, and no LoRA adapter needs the 16-bit input."""
        return self.linear_method.input_quantization == FP8_PER_TOKEN and self.lora is None

    def forward(self, x: torch.Tensor, keep_partials: bool = False) -> torch.Tensor:
        """keep_partials: the caller's next kernel can add a split-K matmul's slices itself
        (a SplitKPartials may come back); honoured where no bias or LoRA delta must be added."""
        if keep_partials and self.linear_method.keeps_partials and self.bias is None and self.lora is None:
            return self.linear_method.apply(self, x, None, keep_partials=True)
        y = self.linear_method.apply(self, x, self.bias)
        if self.lora is not None:
            mapping = get_lora_mapping()
            if mapping is not None:  # some row of this step uses an adapter
                kernels.add_lora(y, x, self.lora.a, self.lora.b, mapping.slots)
        return y


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, linear_method: LinearMethod | None = None) -> None:
        super().__init__(in_features, out_features, bias, dtype, None, linear_method)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank keeps its slice of the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, gather_output: bool = False,
                 linear_method: LinearMethod | None = None) -> None:
        tp = get_tp_size()
        if out_features % tp:
            raise ValueError(f"{out_features} output features do not split over {tp} ranks")
        self.gather_output = gather_output
        super().__init__(in_features, out_features // tp, bias, dtype, 0, linear_method)

    def forward(self, x: torch.Tensor, keep_partials: bool = False) -> torch.Tensor:
        # (Each rank holds whole sums of its columns, so slices need no all-reduce; a gathered
        # output does need the sum.)
        if self.gather_output:
            return tp_all_gather_last_dim(super().forward(x))
        return super().forward(x, keep_partials)

    @property
    def full_lora_shape(self) -> tuple[int, list[int]]:
        return self.in_features, [rows * self.tp_size for rows in self.part_sizes]

    def shard_lora(self, a: torch.Tensor, b: torch.Tensor,
                   part: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """B's rows split like the weight's, part by part (the input is whole on every rank)."""
        if self.tp_size == 1:
            return a, b
        full = self.full_lora_shape[1]
        pieces, start = [], 0
        for p in (range(len(full)) if part is None else [part]):
            rows = b[start:start + full[p]] if part is None else b
            pieces.append(self._lora_rows(rows, p))
            start += full[p]
        return a, torch.cat(pieces)

    def _lora_rows(self, rows: torch.Tensor, part: int) -> torch.Tensor:
        size = self.part_sizes[part]
        return rows.narrow(0, self.tp_rank * size, size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate and up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32, linear_method: LinearMethod | None = None) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, dtype, False, linear_method)

    @property
    def part_sizes(self) -> list[int]:
        return [size // self.tp_size for size in self.output_sizes]  # this rank's rows of each

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        tp = self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        loaded = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(loaded)


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections in one matmul; heads are split across ranks (kv heads are
    replicated when there are fewer of them than ranks)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype: torch.dtype = torch.float32,
                 linear_method: LinearMethod | None = None) -> None:
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.total_num_kv_heads = num_kv_heads
        self.num_kv_heads = max(1, num_kv_heads // tp)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias, dtype, False, linear_method)

    @property
    def part_sizes(self) -> list[int]:
        kv = self.num_kv_heads * self.head_dim
        return [self.num_heads * self.head_dim, kv, kv]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str = "q") -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        if shard_id == "q" or self.total_num_kv_heads >= self.tp_size:
            start = self.tp_rank * size
        else:  # fewer kv heads than ranks: neighbouring ranks replicate one kv head
            start = self.tp_rank * self.total_num_kv_heads // self.tp_size * self.head_dim
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))

    @property
    def full_lora_shape(self) -> tuple[int, list[int]]:
        q, kv = self.part_sizes[:2]
        return self.in_features, [q * self.tp_size, self.total_num_kv_heads * self.head_dim,
                                  self.total_num_kv_heads * self.head_dim]

    def _lora_rows(self, rows: torch.Tensor, part: int) -> torch.Tensor:
        size = self.part_sizes[part]
        if part == 0 or self.total_num_kv_heads >= self.tp_size:
            return rows.narrow(0, self.tp_rank * size, size)
        return rows.narrow(0, self.tp_rank * self.total_num_kv_heads // self.tp_size * self.head_dim, size)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed (all-reduce)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, linear_method: LinearMethod | None = None) -> None:
        tp = get_tp_size()
        if in_features % tp:
            raise ValueError(f"{in_features} input features do not split over {tp} ranks")
        super().__init__(in_features // tp, out_features, bias, dtype, 1, linear_method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.dim() == 1:  # bias: added once, not per shard
            param.data.copy_(loaded if self.tp_rank == 0 else torch.zeros_like(loaded))
            return
        super().weight_loader(param, loaded)

    @property
    def full_lora_shape(self) -> tuple[int, list[int]]:
        return self.in_features * self.tp_size, self.part_sizes

    def shard_lora(self, a: torch.Tensor, b: torch.Tensor,
                   part: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A's columns split like the weight's: each rank's partial delta joins the all-reduce."""
        if self.tp_size == 1:
            return a, b
        return a.narrow(1, self.tp_rank * self.in_features, self.in_features), b

    def forward(self, x: torch.Tensor, keep_partials: bool = False) -> torch.Tensor:
        # Slices are this rank's alone: with several ranks the all-reduce needs the sum.
        if self.tp_size == 1:
            return super().forward(x, keep_partials)
        return tp_all_reduce(super().forward(x))
