"""Preemption by swap: the host pool's bookkeeping and the scheduler's side of moving a
preempted sequence's KV blocks to host memory and back (plain Python, no tensors).

A swapped-out sequence keeps its computed tokens: its computed blocks are copied to host blocks
(`SchedulerOutput.blocks_to_swap_out`, (device block, host block) pairs), its device blocks are
freed, and it waits with status SWAPPED. When it is admitted again it gets device blocks and
`blocks_to_swap_in` ((host block, device block) pairs) copies them back before the step's
forward pass; its host blocks are free once the step is taken. The worker applies a step's
swap-outs before anything of the step writes a block, and its swap-ins after them, on one copy
stream, so a host block freed by a swap-in can take the next step's swap-out at once.

The host pool (backend/core/host_block_pool.py) also holds the prefix cache's host tier; a
swapped-out sequence's blocks are held there, so the tier never evicts them.

A block the sequence shares (a forked sibling, a prefix-cache hit) is copied like the others;
freeing the sequence's table only drops its reference, so the other holders keep it.
"""
from __future__ import annotations

from .block_manager import BlockManager
from .host_block_pool import HostBlockPool
from .sequence import Sequence

class KVSwapper:
    """The scheduler's swap path: which preemptions swap (the mode), the host blocks and copies
    they take, and the counters."""

    def __init__(self, host_pool: HostBlockPool, mode: str, block_manager: BlockManager) -> None:
        if mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode must be recompute, swap or auto, got {mode!r}")
        self.host_pool = host_pool
        self.mode = mode
        self.block_manager = block_manager
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0
        self.num_swapped_preemptions = 0
        self.num_swapped = 0  # sequences waiting with their blocks in host memory now

    def should_swap(self, seq: Sequence, chunk_cap: int) -> bool:
        """recompute: never. swap: whenever the host pool has room. auto: also only when its
        computed tokens exceed one step's prompt chunk: recomputing those takes a step of its
        own (or several), while a shorter recompute rides in the step that resumes it anyway."""
        if self.mode == "recompute" or seq.num_computed_tokens == 0:
            return False
        held = self.block_manager.blocks_needed(seq.num_computed_tokens) - seq.num_released_blocks
        if self.host_pool.num_free_blocks < held:
            return False
        return self.mode == "swap" or seq.num_computed_tokens > chunk_cap

    def swap_out(self, seq: Sequence) -> None:
        """Map the blocks holding the sequence's computed tokens to host blocks and free its
        device blocks (the caller then parks it as SWAPPED). A block the sequence took by a
        copy-on-write in this same step has no contents yet: its source block is copied."""
        n = self.block_manager.blocks_needed(seq.num_computed_tokens)
        released = seq.num_released_blocks  # out of every layer's window: nothing to keep
        pending = {dst: src for src, dst in self.block_manager.pending_copies}
        host = self.host_pool.allocate(n - released)
        self.host_pool.copy_out([(pending.get(b, b), h) for b, h in zip(seq.block_table[released:n], host)])
        seq.host_block_table = host
        self.block_manager.free(seq)
        seq.num_released_blocks = released  # its table is rebuilt past them on swap-in
        self.num_blocks_swapped_out += n - released
        self.num_swapped_preemptions += 1
        self.num_swapped += 1

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """After the sequence's device blocks are allocated: the copies back into its leading
        blocks. Its host blocks are free once the step is taken (the step's copies out, made
        first, must not take them)."""
        host, seq.host_block_table = seq.host_block_table, []
        self.host_pool.release_after_step(host)
        self.num_blocks_swapped_in += len(host)
        self.num_swapped -= 1
        first = seq.num_released_blocks
        return list(zip(host, seq.block_table[first:first + len(host)]))

    def drop(self, seq: Sequence) -> None:
        """A swapped sequence finished (aborted): its host blocks are free, and a swap-out into
        them that no step carried yet is dropped."""
        self.host_pool.drop_copies_out(set(seq.host_block_table))
        self.host_pool.free(seq.host_block_table)
        seq.host_block_table = []
        self.num_swapped -= 1

    def stats(self) -> dict[str, float | int]:
        """Counters, as EngineStats names them."""
        return {"num_swapped": self.num_swapped,
                "num_blocks_swapped_out": self.num_blocks_swapped_out,
                "num_blocks_swapped_in": self.num_blocks_swapped_in,
                "num_swapped_preemptions": self.num_swapped_preemptions}
