"""HostBlockPool: the bookkeeping of swap_space's host KV blocks (plain Python, no tensors).

One pool serves two uses. Held blocks (ref_cnt > 0) hold a swapped-out sequence's blocks
(preemption by swap, backend/core/kv_swap.py) or are read by a copy back to the device in the
step being planned; they are never evicted. Cached blocks (ref_cnt == 0, with a block hash) are
the prefix cache's host tier (backend/core/host_prefix_cache.py): full blocks the device
evicted, kept under their hash and evicted least recently used first when a block is needed.

The copies the next launched step carries are queued here, in one list, in the order they were
planned: a host block evicted and taken again within one step gets its copies in that order.
The worker makes a step's copies out before its copies in, so a host block whose copy in is
planned must not be handed out again until the step is taken (`release_after_step`).
"""
from __future__ import annotations

from collections import OrderedDict


class HostBlockPool:
    """Host KV blocks: never-used ones are handed out lowest id first, so that a sequence's blocks
    tend to form runs (the worker copies a run of consecutive host blocks at once); then cached
    ones, least recently used first."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be non-negative, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # no hash; popped from the end: lowest first
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unheld: least recently used first
        self.cached: dict[bytes, int] = {}  # block hash -> host block
        self._num_held = 0
        self._pending_out: list[tuple[int, int]] = []  # (device block, host block), in planned order
        self._release: list[int] = []  # held until the step being planned is taken
        self.num_evicted = 0  # cached blocks dropped to make room

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (never used, or cached and evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def usage(self) -> float:
        """Fraction of host blocks held (vLLM's cpu_cache_usage_perc); cached ones count as free,
        as the device's evictable cached blocks do."""
        return self._num_held / self.num_blocks if self.num_blocks else 0.0

    # ---- held blocks ------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n held blocks, evicting cached ones when no never-used block is left."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"host pool: {n} blocks asked for, {self.num_free_blocks} free")
        blocks = [self._pop_free() for _ in range(n)]
        for block in blocks:
            self.ref_cnt[block] = 1
        self._num_held += n
        return blocks

    def _pop_free(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._lru.popitem(last=False)
        del self.cached[self.block_hash[block]]
        self.block_hash[block] = None
        self.num_evicted += 1
        return block

    def hold(self, block: int) -> None:
        """Take one more reference to a block (a cached one stops being evictable)."""
        if self.ref_cnt[block] == 0:
            self._lru.pop(block)
            self._num_held += 1
        self.ref_cnt[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop a reference to each block; one nobody holds is free again, or cached (most
        recently used) when it has a hash."""
        freed = False
        for block in blocks:
            assert self.ref_cnt[block] > 0, f"host block {block} is not in use"
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self._num_held -= 1
                if self.block_hash[block] is None:
                    self._free.append(block)
                    freed = True
                else:
                    self._lru[block] = None
        if freed:
            self._free.sort(reverse=True)

    def release_after_step(self, blocks: list[int]) -> None:
        """Free the blocks once the step being planned is taken: a copy in of that step reads
        them after its copies out, which could otherwise write them."""
        self._release += blocks

    # ---- cached blocks ----------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def touch(self, block: int) -> None:
        """Mark a cached block most recently used."""
        if self.ref_cnt[block] == 0:
            self._lru.move_to_end(block)

    def store(self, block_hash: bytes) -> int | None:
        """A block for a device block being evicted, cached under its hash (not cached yet; the
        caller queues the copy), evicting the least recently used; None when every block is held."""
        assert block_hash not in self.cached
        if not self.num_free_blocks:
            return None
        block = self._pop_free()
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block
        self._lru[block] = None
        return block

    def clear_cached(self) -> None:
        """Forget every cached hash (the device's prefix cache was reset: contents are suspect)."""
        for block_hash, block in self.cached.items():
            self.block_hash[block] = None
            if self.ref_cnt[block] == 0:
                self._free.append(block)
        self._lru.clear()
        self.cached.clear()
        self._free.sort(reverse=True)

    # ---- the copies of a step ---------------------------------------------------------------
    def copy_out(self, pairs: list[tuple[int, int]]) -> None:
        """Queue (device block, host block) copies for the next launched step."""
        self._pending_out += pairs

    def drop_copies_out(self, host_blocks: set[int]) -> None:
        """Unqueue the copies into these host blocks (their holder is gone)."""
        self._pending_out = [p for p in self._pending_out if p[1] not in host_blocks]

    def take_copies_out(self) -> list[tuple[int, int]]:
        """The launched step's copies out; the blocks its copies in read are free from now on
        (the worker's copy stream orders their next use after those reads)."""
        out, self._pending_out = self._pending_out, []
        released, self._release = self._release, []
        self.free(released)
        return out

    # ---- invariants -------------------------------------------------------------------------
    def check_integrity(self, seqs: list | None = None) -> None:
        """Free, cached and held blocks partition the pool; with `seqs` (every sequence), the held
        ones are exactly the swapped sequences' host tables and the blocks awaiting release."""
        held = {b for b in range(self.num_blocks) if self.ref_cnt[b] > 0}
        assert len(held) == self._num_held, f"{len(held)} held, counted {self._num_held}"
        assert len(self._free) == len(set(self._free)) and not held.intersection(self._free)
        assert not held.intersection(self._lru) and not set(self._free).intersection(self._lru)
        assert len(self._free) + len(self._lru) + len(held) == self.num_blocks
        assert all(self.block_hash[b] is None for b in self._free), "a free block has a hash"
        for block_hash, block in self.cached.items():
            assert self.block_hash[block] == block_hash, f"host block {block} hash not mapped"
        assert sum(h is not None for h in self.block_hash) == len(self.cached)
        if seqs is not None:
            refs = [0] * self.num_blocks
            for b in [b for s in seqs for b in s.host_block_table] + self._release:
                refs[b] += 1
            assert refs == self.ref_cnt, "host blocks held are not the swapped sequences' and released ones"
