"""Preemption by swap: the host pool's bookkeeping and the scheduler's side of moving a
preempted sequence's KV blocks to host memory and back (plain Python, no tensors).

A swapped-out sequence keeps its computed tokens: its computed blocks are copied to host blocks
(`SchedulerOutput.blocks_to_swap_out`, (device block, host block) pairs), its device blocks are
freed, and it waits with status SWAPPED. When it is admitted again it gets device blocks and
`blocks_to_swap_in` ((host block, device block) pairs) copies them back before the step's
forward pass; its host blocks are free from then on. The worker applies a step's swap-outs
before anything of the step writes a block, and its swap-ins after them, on one copy stream,
so a host block freed by a swap-in can take the next swap-out at once.

A block the sequence shares (a forked sibling, a prefix-cache hit) is copied like the others;
freeing the sequence's table only drops its reference, so the other holders keep it.
"""
from __future__ import annotations

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


class HostBlockPool:
    """Host KV blocks, handed out lowest id first so that a sequence's blocks tend to form runs
    (the worker copies a run of consecutive host blocks at once)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be non-negative, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: lowest first
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of host blocks holding a swapped-out block (vLLM's cpu_cache_usage_perc)."""
        return len(self._used) / self.num_blocks if self.num_blocks else 0.0

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"host pool: {n} blocks asked for, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            assert block in self._used, f"host block {block} is not in use"
            self._used.remove(block)
        self._free.extend(blocks)
        self._free.sort(reverse=True)

    def check_integrity(self, seqs: list[Sequence] | None = None) -> None:
        """Free and used blocks partition the pool; with `seqs` (every sequence), the used ones
        are exactly the swapped sequences' host tables."""
        assert len(self._free) + len(self._used) == self.num_blocks
        assert not self._used.intersection(self._free), "a host block is free and used"
        if seqs is not None:
            held = [b for s in seqs for b in s.host_block_table]
            assert len(held) == len(set(held)), "a host block is held twice"
            assert set(held) == self._used, f"host blocks held {sorted(held)} != used {sorted(self._used)}"


class KVSwapper:
    """The scheduler's swap path: which preemptions swap (the mode), the host pool, the copies
    the next launched step carries, and the counters."""

    def __init__(self, host_pool: HostBlockPool, mode: str, block_manager: BlockManager) -> None:
        if mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode must be recompute, swap or auto, got {mode!r}")
        self.host_pool = host_pool
        self.mode = mode
        self.block_manager = block_manager
        # Swap-outs of sequences preempted since the last launched step (a step with nothing
        # scheduled is not launched, so they wait for the next one).
        self._pending_out: list[tuple[int, int]] = []
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
        if self.host_pool.num_free_blocks < self.block_manager.blocks_needed(seq.num_computed_tokens):
            return False
        return self.mode == "swap" or seq.num_computed_tokens > chunk_cap

    def swap_out(self, seq: Sequence) -> None:
        """Map the blocks holding the sequence's computed tokens to host blocks and free its
        device blocks (the caller then parks it as SWAPPED). A block the sequence took by a
        copy-on-write in this same step has no contents yet: its source block is copied."""
        n = self.block_manager.blocks_needed(seq.num_computed_tokens)
        pending = {dst: src for src, dst in self.block_manager.pending_copies}
        host = self.host_pool.allocate(n)
        self._pending_out += [(pending.get(b, b), h) for b, h in zip(seq.block_table[:n], host)]
        seq.host_block_table = host
        self.block_manager.free(seq)
        self.num_blocks_swapped_out += n
        self.num_swapped_preemptions += 1
        self.num_swapped += 1

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """After the sequence's device blocks are allocated: the copies back into its leading
        blocks. Its host blocks are free again (the copy stream orders their next use)."""
        host, seq.host_block_table = seq.host_block_table, []
        self.host_pool.free(host)
        self.num_blocks_swapped_in += len(host)
        self.num_swapped -= 1
        return list(zip(host, seq.block_table[:len(host)]))

    def drop(self, seq: Sequence) -> None:
        """A swapped sequence finished (aborted): its host blocks are free, and a swap-out into
        them that no step carried yet is dropped."""
        host = set(seq.host_block_table)
        self._pending_out = [p for p in self._pending_out if p[1] not in host]
        self.host_pool.free(seq.host_block_table)
        seq.host_block_table = []
        self.num_swapped -= 1

    def take_swap_outs(self) -> list[tuple[int, int]]:
        out, self._pending_out = self._pending_out, []
        return out

    def stats(self) -> dict[str, float | int]:
        """Counters and the host pool's usage, as EngineStats names them."""
        return {"num_swapped": self.num_swapped, "cpu_cache_usage": self.host_pool.usage,
                "num_blocks_swapped_out": self.num_blocks_swapped_out,
                "num_blocks_swapped_in": self.num_blocks_swapped_in,
                "num_swapped_preemptions": self.num_swapped_preemptions}


def is_swapped(seq: Sequence) -> bool:
    return seq.status == SequenceStatus.SWAPPED
