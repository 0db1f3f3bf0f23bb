"""BlockManager: the paged KV cache's bookkeeping (no tensors here).

Blocks are ref-counted. Full blocks are content-addressed by a chained SHA-256 (of the parent
block's hash and this block's tokens; the chain's root hashes the request's LoRA adapter and
cache_salt), so a new prompt that starts with the same tokens, adapter and salt reuses them
(prefix caching). A cryptographic hash because a collision would serve one request another's
keys and values (vLLM's GHSA-rm76-4mrf-v9r8: Python's `hash()` of a tuple is easy to collide). A freed block keeps its hash and stays in the free
queue, which is also the LRU order for eviction: it is only forgotten when the queue hands it out
again. Sequences forked for n > 1 share blocks; writing into a shared partial block copies it first
(copy-on-write), and the copies are handed to the model runner. With swap_space, an evicted cached
block goes on to the host tier (backend/core/host_prefix_cache.py), where a lookup that ends on
the device continues.

With a `sliding_window` (every layer of the model attends to at most that many past tokens), the
leading blocks no future query can see are given back as the sequence grows. The table keeps
their positions (`Sequence.num_released_blocks` counts them) and the stale ids there, so the
worker's copy needs no update: the ids are no longer the sequence's, and the attention kernels
never use keys before a query's window. A model with one full-attention layer keeps every block.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .block_hash import NONE_HASH, hash_block_tokens, hash_prompt_blocks, root_block_hash  # noqa: F401 (public here)
from .sequence import Sequence

if TYPE_CHECKING:
    from .host_prefix_cache import HostPrefixCache


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


@dataclass(frozen=True)
class PrefixHit:
    """A prefix-cache lookup: the cached device blocks a prompt starts with, the host tier's
    blocks that continue them, the tokens both hold, and the tokens looked up (counted in the
    cache's statistics once the blocks are taken)."""
    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_tokens: int = 0
    num_queried: int = 0
    host_blocks: list[int] = field(default_factory=list)


# What a released position holds in a table rebuilt after swap-in: any valid id does, as no
# kernel uses keys there (see the module docstring).
NULL_BLOCK_ID = 0

class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
        self.sliding_window = sliding_window
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Blocks with ref_cnt == 0, least recently freed first: allocation pops from the front.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}  # block hash -> block
        self._pending_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write this step
        self._seq_hashes: dict[int, list[bytes]] = {}  # seq_id -> hashes of its full blocks
        self._prefix_cache_queries = 0  # tokens
        self._prefix_cache_hits = 0  # tokens, the host tier's included
        self.host_tier: HostPrefixCache | None = None  # with swap_space and prefix caching
        self.held: dict[str, list[int]] = {}  # blocks kept for another engine to read, by key

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (never used, or cached and evictable)."""
        return len(self.free_queue)

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache by admitted sequences."""
        return self._prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of those, tokens found cached."""
        return self._prefix_cache_hits

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, seq: Sequence) -> list[bytes]:
        """Chained hashes of the sequence's full blocks (its prompt's, when the input processor
        made them, to start with), extended as its tokens grow."""
        hashes = self._seq_hashes.get(seq.seq_id)
        if hashes is None:
            hashes = self._seq_hashes[seq.seq_id] = list(seq.prompt_block_hashes)
        bs = self.block_size
        known = seq.num_tokens - seq.num_unresolved  # placeholders have no id yet
        for i in range(len(hashes), known // bs):
            parent = hashes[i - 1] if i else seq.block_hash_root
            hashes.append(hash_block_tokens(parent, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, seq: Sequence) -> PrefixHit:
        """Longest cached prefix of full blocks, on the device and then in the host tier, never
        covering the last token (its logits are needed). The lookup counts in the statistics
        when `allocate_slots` takes the hit."""
        if not self.enable_prefix_caching:
            return PrefixHit()
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(seq)[:max_blocks]
        hits: list[KVCacheBlock] = []
        for block_hash in hashes:
            block = self.cached_blocks.get(block_hash)
            if block is None:
                break
            hits.append(block)
        host = self.host_tier.lookup(hashes[len(hits):]) if self.host_tier is not None else []
        return PrefixHit(hits, (len(hits) + len(host)) * self.block_size, seq.num_tokens, host)

    # ---- allocation -------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make the block table cover `num_computed_tokens + num_new_tokens` tokens.

        A prefix-cache `hit` (only for a sequence with an empty table) is taken first, and its
        lookup counted; its host-tier blocks are copied into fresh blocks in the step. Returns
        False, changing nothing but the blocks given back out of the window, when there are not
        enough free blocks.
        """
        computed_blocks = hit.blocks if hit is not None else None
        if self.sliding_window is not None and seq.block_table:
            self.release_out_of_window(seq)
        if not computed_blocks and hit is None:  # the common case, a running sequence: usually nothing to do
            table = seq.block_table
            num_computed = seq.num_computed_tokens
            needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(table)
            if needed <= 0 and (num_computed % self.block_size == 0
                                or self.blocks[table[num_computed // self.block_size]].ref_cnt == 1):
                return True
        computed_blocks = computed_blocks or []
        host_blocks = hit.host_blocks if hit is not None else []
        assert not (computed_blocks or host_blocks) or not seq.block_table
        num_computed = hit.num_tokens if hit is not None and hit.num_tokens else seq.num_computed_tokens
        total = num_computed + num_new_tokens
        # A sequence swapped in after giving blocks back: those positions stay unbacked; and of
        # a prefix hit, only the blocks the next query's window reaches are taken.
        released = seq.num_released_blocks if not seq.block_table and not computed_blocks else 0
        if computed_blocks and self.sliding_window is not None:
            released = min(len(computed_blocks), max(0, (num_computed - self.sliding_window + 1) // self.block_size))
            computed_blocks = computed_blocks[released:]
        num_table = len(seq.block_table) or (released + len(computed_blocks)) or released
        needed = max(0, self.blocks_needed(total) - num_table)
        cow = self._needs_copy_on_write(seq, num_computed)
        # Hits that sit in the free queue stop being free once taken.
        reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if needed + int(cow) + reclaimed > len(self.free_queue):
            return False
        if hit is not None:
            self._prefix_cache_queries += hit.num_queried
            self._prefix_cache_hits += hit.num_tokens
            if self.host_tier is not None:  # what the device did not hold was looked up there
                self.host_tier.num_query_tokens += hit.num_queried - (released + len(computed_blocks)) * self.block_size
        if released:
            seq.block_table.extend([NULL_BLOCK_ID] * released)
            seq.num_released_blocks = released
        for block in computed_blocks:
            self._touch(block)
            seq.block_table.append(block.block_id)
        if host_blocks:
            self.host_tier.hold(host_blocks)
        if cow:
            self._copy_on_write(seq)
        for _ in range(needed):
            seq.block_table.append(self._pop_free().block_id)
        if host_blocks:
            self._reload(seq, released + len(computed_blocks), host_blocks)
        return True

    def max_sequence_tokens(self, max_step_tokens: int) -> int | None:
        """The most tokens one sequence can grow to before it needs more blocks than the cache
        has; None: no bound, as with a window a sequence holds only the blocks its window and one
        step's tokens (at most `max_step_tokens`) reach."""
        if self.sliding_window is not None and \
                self.blocks_needed(self.sliding_window - 1 + max_step_tokens) + 1 <= self.num_blocks:
            return None
        return self.num_blocks * self.block_size

    def release_out_of_window(self, seq: Sequence) -> int:
        """Give back the leading blocks whose keys no future query sees: a query at position p
        sees keys p - W < k <= p, and the next query is at num_computed_tokens. With prefix
        caching a block goes only once it is offered to the cache, so it stays a hit for other
        prompts until evicted. Returns the number given back now."""
        first = seq.num_released_blocks
        end = (seq.num_computed_tokens - self.sliding_window + 1) // self.block_size
        if self.enable_prefix_caching:
            end = min(end, seq.num_cached_blocks)
        end = min(end, len(seq.block_table))
        if end <= first:
            return 0
        table = seq.block_table
        for i in range(first, end):
            self._unref(table[i])
        seq.num_released_blocks = end
        return end - first

    def _reload(self, seq: Sequence, first: int, host_blocks: list[int]) -> None:
        """The fresh blocks after the device hits take the host hits' contents and hashes: they
        are cached on the device from now on (the step's forward pass reads them after the copy)."""
        device = seq.block_table[first:first + len(host_blocks)]
        hashes = self._block_hashes(seq)[first:first + len(host_blocks)]
        for block_id, block_hash in zip(device, hashes):
            if block_hash not in self.cached_blocks:  # else another device block holds it already
                self.blocks[block_id].block_hash = block_hash
                self.cached_blocks[block_hash] = self.blocks[block_id]
        self.host_tier.load(host_blocks, device)

    def _needs_copy_on_write(self, seq: Sequence, num_computed: int) -> bool:
        """The next token is written into a partial block that another sequence also holds."""
        if not seq.block_table or num_computed % self.block_size == 0:
            return False
        idx = num_computed // self.block_size
        return idx < len(seq.block_table) and self.blocks[seq.block_table[idx]].ref_cnt > 1

    def _copy_on_write(self, seq: Sequence) -> None:
        idx = seq.num_computed_tokens // self.block_size
        src = self.blocks[seq.block_table[idx]]
        dst = self._pop_free()
        src.ref_cnt -= 1
        seq.block_table[idx] = dst.block_id
        self._pending_copies.append((src.block_id, dst.block_id))

    def _touch(self, block: KVCacheBlock) -> None:
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1

    def _pop_free(self) -> KVCacheBlock:
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:  # evict: its contents are about to be overwritten
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
                if self.host_tier is not None:
                    self.host_tier.offload(block.block_id, block.block_hash)
            block.block_hash = None
        assert block.ref_cnt == 0
        block.ref_cnt = 1
        return block

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.block_table = list(parent.block_table)
        child.num_cached_blocks = parent.num_cached_blocks
        child.num_released_blocks = parent.num_released_blocks
        for block_id in child.block_table[child.num_released_blocks:]:
            self.blocks[block_id].ref_cnt += 1
        self._seq_hashes[child.seq_id] = list(self._seq_hashes.get(parent.seq_id, []))

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks. Tail blocks are freed first so that they are evicted
        before the (more widely shared) head of a prefix. A copy-on-write into one of them that
        no step has made yet is dropped: its destination is free again."""
        held = seq.block_table[seq.num_released_blocks:]
        if self._pending_copies:
            mine = set(held)
            self._pending_copies = [c for c in self._pending_copies if c[1] not in mine]
        for block_id in reversed(held):
            self._unref(block_id)
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.num_released_blocks = 0

    def hold(self, key: str, block_ids: list[int]) -> None:
        """One more reference on each block, under `key` (disaggregated prefill: a finished
        prompt's blocks wait for the consumer's read, or a read into them for its end)."""
        for block_id in block_ids:
            self._touch(self.blocks[block_id])
        self.held[key] = list(block_ids)

    def release(self, key: str) -> None:
        for block_id in reversed(self.held.pop(key, [])):
            self._unref(block_id)

    def _unref(self, block_id: int) -> None:
        """One reference fewer; a block nobody holds joins the free queue (at its LRU end)."""
        block = self.blocks[block_id]
        assert block.ref_cnt > 0, f"double free of block {block_id}"
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_queue[block_id] = block

    def forget(self, seq: Sequence) -> None:
        """Drop per-sequence state once the sequence is finished for good."""
        self._seq_hashes.pop(seq.seq_id, None)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's full, computed blocks in the prefix cache (after a step)."""
        if not self.enable_prefix_caching:
            return
        known = min(seq.num_computed_tokens, seq.num_tokens - seq.num_unresolved)
        num_full = min(known // self.block_size, len(seq.block_table))
        if num_full <= seq.num_cached_blocks:
            return
        hashes = self._block_hashes(seq)
        # (Released positions hold no block of the sequence's: after a swap-in they restart here.)
        start = max(seq.num_cached_blocks, seq.num_released_blocks)
        seq.num_cached_blocks = num_full
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                continue
            if hashes[i] in self.cached_blocks:
                continue  # same content computed twice: keep the first copy cached
            block.block_hash = hashes[i]
            self.cached_blocks[hashes[i]] = block

    @property
    def pending_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies (src, dst) planned for the step being scheduled."""
        return list(self._pending_copies)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash, the host tier's too (after a failed step, the cache
        contents are suspect)."""
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        if self.host_tier is not None:
            self.host_tier.pool.clear_cached()

    # ---- invariants -------------------------------------------------------------------------
    def check_integrity(self, seqs: list[Sequence] | None = None) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent. With `seqs` (every sequence
        holding blocks), ref counts must equal the number of block-table references."""
        free = cached = in_use = 0
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                assert block.block_id in self.free_queue, f"{block} has no owner and is not free"
                if block.block_hash is None:
                    free += 1
                else:
                    cached += 1
            else:
                assert block.block_id not in self.free_queue, f"{block} is in use and free"
                in_use += 1
            if block.block_hash is not None:
                assert self.cached_blocks.get(block.block_hash) is block, f"{block} hash not mapped"
        assert free + cached + in_use == self.num_blocks
        assert len(self.free_queue) == free + cached
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, f"map entry {block_hash} -> {block}"
        if seqs is not None:
            refs = [0] * self.num_blocks
            for seq in seqs:
                held = seq.block_table[seq.num_released_blocks:]
                assert len(held) == len(set(held)), f"{seq} repeats a block"
                for block_id in held:
                    refs[block_id] += 1
            for block_ids in self.held.values():
                for block_id in block_ids:
                    refs[block_id] += 1
            for block in self.blocks:
                assert block.ref_cnt == refs[block.block_id], \
                    f"{block} has {refs[block.block_id]} references"
