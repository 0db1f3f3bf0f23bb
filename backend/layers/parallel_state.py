"""Tensor-parallel group state. With tensor_parallel_size=1 no process group exists and every
helper is a no-op; with more, each rank's process joins one torch.distributed group (NCCL on
GPUs, gloo on the CPU) and the layers ask this module for their shard."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# How long a collective may wait for the other ranks: a backstop, since a rank that dies closes
# its connections and the others fail at once.
TP_TIMEOUT_S = float(os.environ.get("TRITIUM_TP_TIMEOUT_S", "300"))


def get_tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def init_tp_group(rank: int, world_size: int, port: int, device: torch.device) -> None:
    """Join the group of `world_size` ranks whose rank 0 listens on 127.0.0.1:`port`."""
    if dist.is_initialized():
        raise RuntimeError("this process already serves a tensor-parallel model; one "
                           "tensor-parallel engine per process (shut the other down first)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        # Collectives captured in CUDA graphs must not record their tensors on NCCL's stream
        # (read when the process group is made; vLLM captures torch.distributed all-reduces so).
        os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=TP_TIMEOUT_S))


def destroy_tp_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if get_tp_size() > 1:
        dist.all_reduce(x)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    size = get_tp_size()
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


def tp_broadcast(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` into every rank's `x` (same shape and dtype), in place."""
    if get_tp_size() > 1:
        dist.broadcast(x, src=0)
    return x
