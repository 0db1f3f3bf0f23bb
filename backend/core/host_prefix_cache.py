"""The prefix cache's host tier: full blocks the device evicts are kept in swap_space's host pool
under their block hash, and a prompt whose cached prefix ends on the device continues its lookup
here; its hits are copied back into fresh device blocks instead of being computed again.

Plain Python: the copies travel in the step (`SchedulerOutput.blocks_to_swap_out` and
`blocks_to_swap_in`). An evicted device block is about to be overwritten by the step being
planned, or a later one; the worker copies a step's blocks out before anything of the step writes
a block, so the copy reads the evicted contents. A block copied back is registered in the device's
prefix cache at once (the step's forward pass reads it only after the copy lands), and its host
block stays cached: when the device evicts that block again, nothing needs copying.
"""
from __future__ import annotations

from .host_block_pool import HostBlockPool


class HostPrefixCache:
    """The host tier's side of the block manager: offload on eviction, look up, load back."""

    def __init__(self, pool: HostBlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._pending_in: list[tuple[int, int]] = []  # (host block, device block) this step
        self.num_blocks_offloaded = 0  # device -> host copies of evicted blocks
        self.num_blocks_reloaded = 0  # host -> device copies of prefix hits
        self.num_query_tokens = 0  # prompt tokens looked up here: those the device did not hold
        self.num_hit_tokens = 0  # prompt tokens found here (a part of the prefix-cache hits)

    def offload(self, device_block: int, block_hash: bytes) -> None:
        """The device evicts a cached block: keep a copy unless the host has the hash already (or
        every host block is held by swapped-out sequences)."""
        host = self.pool.lookup(block_hash)
        if host is not None:
            self.pool.touch(host)
            return
        host = self.pool.store(block_hash)
        if host is not None:
            self.pool.copy_out([(device_block, host)])
            self.num_blocks_offloaded += 1

    def lookup(self, block_hashes: list[bytes]) -> list[int]:
        """The host blocks holding the leading run of these hashes."""
        hits: list[int] = []
        for block_hash in block_hashes:
            host = self.pool.lookup(block_hash)
            if host is None:
                break
            hits.append(host)
        return hits

    def hold(self, host_blocks: list[int]) -> None:
        """Keep a hit's host blocks from eviction while the device blocks they go to are taken
        (taking them may offload other blocks into the pool)."""
        for host in host_blocks:
            self.pool.hold(host)

    def load(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Copy held hits into their device blocks in the step being planned; the host blocks
        stay held until the step is taken."""
        self._pending_in += zip(host_blocks, device_blocks)
        self.pool.release_after_step(host_blocks)
        self.num_blocks_reloaded += len(host_blocks)
        self.num_hit_tokens += len(host_blocks) * self.block_size

    def take_copies_in(self) -> list[tuple[int, int]]:
        copies, self._pending_in = self._pending_in, []
        return copies

    def stats(self) -> dict[str, int]:
        """Counters as EngineStats names them."""
        return {"external_prefix_cache_queries": self.num_query_tokens,
                "external_prefix_cache_hits": self.num_hit_tokens,
                "num_blocks_offloaded": self.num_blocks_offloaded,
                "num_blocks_reloaded": self.num_blocks_reloaded}
