"""HostKVCache: a rank's host copy space for preemption by swap, and the copies between it and
the device's KV pool (each tensor-parallel rank swaps its own shard of every block).

The host pool is [num_host_blocks, 2, layers, block_size, Hkv, D] bytes, pinned on a GPU host:
a host block is contiguous, so a run of consecutive host blocks is one copy. The device pool is
the Worker's [2, layers, num_blocks, block_size, Hkv, D] (bytes viewed in the cache dtype;
copies move bytes, so FP8 caches need nothing more).

Ordering on a GPU. Swap-out: one gather of the device blocks on the compute stream (so it reads
them after the steps before wrote them and before this step's forward pass can overwrite them),
then the device->host copies on the copy stream, which waits for the gather. Swap-in: the
host->device copies on the copy stream (behind every earlier swap-out, so a host block is read
only after it was written), then one scatter on the compute stream, which waits for them, so
the step's forward pass reads the blocks only once they have landed. The host never touches
the host pool, so nothing here blocks the host.
"""
from __future__ import annotations

import weakref

import torch

from ..layers.sampling_metadata import host_to_device

# Device staging for one batch of copies: the memory profile does not reserve it, so a large
# swap is moved in batches of at most this many bytes.
STAGING_BYTES = 64 * 1024 * 1024


def _pin(tensor: torch.Tensor) -> None:
    """Page-lock the tensor's memory in place, for asynchronous copies. Not `pin_memory=True`:
    PyTorch's pinned allocator rounds a size up to a power of two (10 GiB would lock 16)."""
    cudart = torch.cuda.cudart()
    ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    err = cudart.cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        raise RuntimeError(f"swap_space: cannot pin {size / (1 << 30):.2f} GiB of host memory "
                           f"(cudaHostRegister error {int(err)})")
    weakref.finalize(tensor, cudart.cudaHostUnregister, ptr)


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in `ids`, first id, length) of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for pos, block in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == block and runs[-1][0] + runs[-1][2] == pos:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((pos, block, 1))
    return runs


class HostKVCache:
    """A rank's host blocks and the batched copies to and from its device KV pool."""

    def __init__(self, device_pool: torch.Tensor, num_host_blocks: int) -> None:
        raw = device_pool.view(torch.uint8)
        self.device_raw = raw
        self.device = raw.device
        shape = (num_host_blocks, raw.shape[0], raw.shape[1], *raw.shape[3:])
        pin = raw.device.type == "cuda"
        self.host = torch.empty(shape, dtype=torch.uint8)
        if pin and self.host.numel():
            _pin(self.host)
        self.copy_stream = torch.cuda.Stream(raw.device) if pin else None
        block_bytes = self.host[0].numel() if num_host_blocks else 1
        self.max_batch = max(1, STAGING_BYTES // block_bytes)

    @property
    def num_blocks(self) -> int:
        return self.host.shape[0]

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return host_to_device(ids, torch.int64, self.device)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: (device block, host block) pairs."""
        for i in range(0, len(pairs), self.max_batch):
            self._swap_out(pairs[i:i + self.max_batch])

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks: (host block, device block) pairs."""
        for i in range(0, len(pairs), self.max_batch):
            self._swap_in(pairs[i:i + self.max_batch])

    def _swap_out(self, pairs: list[tuple[int, int]]) -> None:
        staged = self.device_raw.index_select(2, self._ids([p[0] for p in pairs]))
        staged = staged.movedim(2, 0).contiguous()  # [n, 2, layers, block_size, Hkv, D]
        host_ids = [p[1] for p in pairs]
        if self.copy_stream is None:
            for pos, first, length in _runs(host_ids):
                self.host[first:first + length].copy_(staged[pos:pos + length])
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            for pos, first, length in _runs(host_ids):
                self.host[first:first + length].copy_(staged[pos:pos + length], non_blocking=True)
        staged.record_stream(self.copy_stream)  # its memory is not reused before the copies end

    def _swap_in(self, pairs: list[tuple[int, int]]) -> None:
        dst = self._ids([p[1] for p in pairs])
        host_ids = [p[0] for p in pairs]
        shape = (len(pairs), *self.host.shape[1:])
        if self.copy_stream is None:
            staged = torch.empty(shape, dtype=torch.uint8)
            for pos, first, length in _runs(host_ids):
                staged[pos:pos + length].copy_(self.host[first:first + length])
            self.device_raw.index_copy_(2, dst, staged.movedim(0, 2))
            return
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.copy_stream):
            staged = torch.empty(shape, dtype=torch.uint8, device=self.device)
            for pos, first, length in _runs(host_ids):
                staged[pos:pos + length].copy_(self.host[first:first + length], non_blocking=True)
        compute.wait_stream(self.copy_stream)
        self.device_raw.index_copy_(2, dst, staged.movedim(0, 2))
        staged.record_stream(compute)
