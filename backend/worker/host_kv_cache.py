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

Device staging. A batch of copies goes through one of two staging buffers of at most
STAGING_BYTES each, used in turn; a buffer is taken again only after an event marks the end of
its last use (the copy out of it, or the scatter from it), so a large swap never holds more
device memory than `staging_bytes` says, which the memory profile reserves.
"""
from __future__ import annotations

import weakref

import torch

from ..layers.sampling_metadata import host_to_device

# Device staging for one batch of copies: a large swap is moved in batches of at most this many
# bytes, through NUM_STAGING buffers (and one gather's result, on the compute stream).
STAGING_BYTES = 64 * 1024 * 1024
NUM_STAGING = 2


def max_batch_blocks(block_bytes: int) -> int:
    return max(1, STAGING_BYTES // max(1, block_bytes))


def staging_bytes(block_bytes: int) -> int:
    """Device memory the swap copies take at most, besides the KV cache: the staging buffers and
    one batch's gather (the memory profile sets it aside when swap_space is on)."""
    return (NUM_STAGING + 1) * max_batch_blocks(block_bytes) * block_bytes


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
        self.max_batch = max_batch_blocks(block_bytes)
        # On a GPU: the staging buffers, used in turn, and the event ending each one's last use.
        batch_shape = (self.max_batch, *self.host.shape[1:])
        self._staging = [torch.empty(batch_shape, dtype=torch.uint8, device=self.device)
                         for _ in range(NUM_STAGING)] if pin and num_host_blocks else []
        self._released: list[torch.cuda.Event | None] = [None] * len(self._staging)
        self._turn = 0
        # Set to a list by a benchmark: (direction, bytes, start, end) of each batch's copies on
        # the copy stream, timed by CUDA events (the bandwidth the swaps achieve while serving).
        self.copy_log: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] | None = None

    def _mark(self) -> torch.cuda.Event | None:
        if self.copy_log is None:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.copy_stream)
        return event

    def _log(self, direction: str, num_blocks: int, start: torch.cuda.Event | None) -> None:
        if start is not None:
            self.copy_log.append((direction, num_blocks * self.host[0].numel(), start, self._mark()))

    def _take_staging(self, stream: torch.cuda.Stream, n: int) -> tuple[int, torch.Tensor]:
        """The next staging buffer's first n blocks, once `stream` has waited for its last use."""
        i = self._turn
        self._turn = (i + 1) % len(self._staging)
        if self._released[i] is not None:
            stream.wait_event(self._released[i])
        return i, self._staging[i][:n]

    def _release_staging(self, i: int, stream: torch.cuda.Stream) -> None:
        event = torch.cuda.Event()
        event.record(stream)
        self._released[i] = event

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
        gathered = self.device_raw.index_select(2, self._ids([p[0] for p in pairs]))
        host_ids = [p[1] for p in pairs]
        if self.copy_stream is None:
            staged = gathered.movedim(2, 0).contiguous()  # [n, 2, layers, block_size, Hkv, D]
            for pos, first, length in _runs(host_ids):
                self.host[first:first + length].copy_(staged[pos:pos + length])
            return
        compute = torch.cuda.current_stream(self.device)
        i, staged = self._take_staging(compute, len(pairs))
        staged.copy_(gathered.movedim(2, 0))  # block-major, on the compute stream
        del gathered  # (its memory is the compute stream's: reused by its next allocation)
        self.copy_stream.wait_stream(compute)
        with torch.cuda.stream(self.copy_stream):
            start = self._mark()
            for pos, first, length in _runs(host_ids):
                self.host[first:first + length].copy_(staged[pos:pos + length], non_blocking=True)
            self._log("out", len(pairs), start)
        self._release_staging(i, self.copy_stream)

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
        i, staged = self._take_staging(self.copy_stream, len(pairs))
        with torch.cuda.stream(self.copy_stream):
            start = self._mark()
            for pos, first, length in _runs(host_ids):
                staged[pos:pos + length].copy_(self.host[first:first + length], non_blocking=True)
            self._log("in", len(pairs), start)
        compute.wait_stream(self.copy_stream)
        self.device_raw.index_copy_(2, dst, staged.movedim(0, 2))
        self._release_staging(i, compute)
