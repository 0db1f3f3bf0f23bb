"""Scheduler: decides, every step, which tokens of which sequences the model computes.

Iteration-level (continuous batching): each step mixes the running sequences' next tokens
(decodes, or the next chunk of a long prompt) with chunks of waiting prompts, within
`max_num_batched_tokens` tokens and `max_num_seqs` sequences. First come, first served. When the
KV cache runs out, the most recently admitted sequence is preempted: its blocks are freed and it
goes back to the front of the waiting queue, to be recomputed later (its generated tokens are kept),
or, with preemption by swap, its computed blocks are copied to host memory and back when it
resumes (backend/core/kv_swap.py; its computed tokens are kept too).

With policy "priority" (vLLM's), the waiting queue is ordered by (priority, arrival time), lower
first, a preempted sequence included; and the running sequence preempted is the one with the
highest (priority, arrival time).
"""
from __future__ import annotations

import time
from collections import deque

from ..engine_config import SchedulerConfig
from .block_manager import BlockManager
from .host_block_pool import HostBlockPool
from .host_prefix_cache import HostPrefixCache
from .kv_swap import KVSwapper
from .lora_slots import LoRASlots
from .scheduler_output import (Fork, PromptSpan, SampleRow, ScheduledSequence, SchedulerOutput,
                               SpecRun)
from .sequence import Sequence, SequenceStatus
from .worker_view import WorkerView


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 lora_slots: LoRASlots | None = None, num_lookahead_tokens: int = 0,
                 num_host_blocks: int = 0) -> None:
        """lora_slots: with LoRA adapters, the device's adapter slots; a waiting sequence is
        admitted only when its adapter is in a slot or can take one. num_lookahead_tokens: slots
        past the step's tokens for a sequence that samples, where a draft model writes its
        proposals' keys and values after the step (vLLM's lookahead); taken when free.
        num_host_blocks: the worker's host blocks (swap_space) for preemption by swap and the
        prefix cache's host tier (0: neither)."""
        self.num_lookahead_tokens = num_lookahead_tokens
        self.config = config
        self.block_manager = block_manager
        self.lora_slots = lora_slots
        self.policy = config.policy
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        # While others wait, one prompt's chunk takes at most this many tokens of a step, so a
        # newcomer is admitted at once instead of waiting for a long prompt to finish.
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: preemption takes from the end
        # Disaggregated prefill: admitted sequences whose prompt blocks are being read from
        # another engine (`take_remote_loads`, then `finish_remote_load`), and what the engine
        # does with a sequence's blocks before it is freed (a producer keeps them to be read).
        self.loading: list[Sequence] = []
        self._new_loads: list[Sequence] = []
        self.on_finish = None  # Callable[[Sequence], None] | None
        self.num_preemptions = 0
        self._stopped: list[int] = []  # seq ids for the next step's finished_seq_ids
        # Every sequence waiting or running, by id (a step names sequences by id), and the
        # siblings forked by the step planned last, which run once it is launched.
        self.sequences: dict[int, Sequence] = {}
        self._forking: dict[int, Sequence] = {}
        self.worker_view = WorkerView()  # what the worker holds of each sequence
        self.host_pool = HostBlockPool(num_host_blocks) if num_host_blocks else None
        self.swapper = KVSwapper(self.host_pool, config.preemption_mode, block_manager) \
            if self.host_pool is not None and config.preemption_mode != "recompute" else None
        self.host_tier = HostPrefixCache(self.host_pool, block_manager.block_size) \
            if self.host_pool is not None and block_manager.enable_prefix_caching else None
        block_manager.host_tier = self.host_tier

    # ---- queue management -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.sequences[seq.seq_id] = seq
        if self.policy == "priority":
            self._insert_by_priority(seq)
        else:
            self.waiting.append(seq)

    def _insert_by_priority(self, seq: Sequence) -> None:
        """After every waiting sequence that goes before or with it (searched from the back,
        where new arrivals usually land)."""
        key = (seq.priority, seq.arrival_time)
        i = len(self.waiting)
        while i > 0 and (self.waiting[i - 1].priority, self.waiting[i - 1].arrival_time) > key:
            i -= 1
        self.waiting.insert(i, seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running parent (n > 1) joins right after it."""
        seq.status = SequenceStatus.RUNNING
        self._take_lora_slot(seq)
        self.running.append(seq)
        self.sequences[seq.seq_id] = seq

    def _take_lora_slot(self, seq: Sequence) -> None:
        if seq.lora_name is not None:
            seq.lora_slot = self.lora_slots.acquire(seq.lora_name)

    def _drop_lora_slot(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.lora_slots.release(seq.lora_slot)
            seq.lora_slot = -1

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is, freeing its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._drop_lora_slot(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.SWAPPED):
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.WAITING_FOR_REMOTE_KVS:
            self.loading.remove(seq)
            if seq in self._new_loads:
                self._new_loads.remove(seq)
        if seq.host_block_table:
            self.swapper.drop(seq)
        if self.on_finish is not None:
            self.on_finish(seq)
        self.block_manager.free(seq)
        self.block_manager.forget(seq)
        seq.status = SequenceStatus.FINISHED
        self.sequences.pop(seq.seq_id, None)
        self.worker_view.forget(seq.seq_id)
        self._stopped.append(seq.seq_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading)

    def all_sequences(self) -> list[Sequence]:
        return list(self.running) + list(self.waiting) + list(self.loading)

    def take_remote_loads(self) -> list[Sequence]:
        """Sequences admitted since the last call whose prompt blocks are to be read."""
        loads, self._new_loads = self._new_loads, []
        return loads

    def finish_remote_load(self, seq: Sequence) -> None:
        """Its prompt's blocks are read: it runs from the last prompt token on (computed here,
        for its logits), and the read blocks join the prefix cache."""
        self.loading.remove(seq)
        seq.num_computed_tokens = seq.remote_prefill.end
        self.block_manager.cache_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self._take_lora_slot(seq)
        self.running.append(seq)

    def sequence(self, seq_id: int) -> Sequence:
        """A sequence the last step names (a sibling it forks included)."""
        seq = self.sequences.get(seq_id)
        return seq if seq is not None else self._forking[seq_id]

    # ---- the step ----------------------------------------------------------------------------
    def schedule(self, proposals: dict[int, list[int]] | None = None,
                 step_in_flight: bool = False) -> SchedulerOutput:
        """One step's plan. proposals: speculative decoding's proposed tokens per running
        decode (seq_id -> tokens), verified in this step as far as the budget and the cache
        allow. step_in_flight: the previous step's tokens are not on the host yet."""
        out = SchedulerOutput()
        self._forking = {}
        # A row whose sampling reads its sequence's tokens on the host waits for them.
        out.defer_sampling = step_in_flight and any(s.params.needs_output_on_host for s in self.running)
        proposals = proposals or {}
        budget = self.max_num_batched_tokens

        # 1. Running sequences: decodes first, so a long prompt's chunks never stall them,
        #    then prompt chunks, each group in admission order.
        for decodes in (True, False):
            for seq in list(self.running):
                if budget <= 0:
                    break
                remaining = seq.num_tokens - seq.num_computed_tokens
                if (remaining == 1) != decodes or seq.status != SequenceStatus.RUNNING:
                    continue  # the other pass's, or preempted earlier in this loop
                # A decode with proposed tokens (speculative decoding) verifies them in this step,
                # as many as the budget leaves room for.
                spec = proposals.get(seq.seq_id, []) if decodes else []
                num_new = min(remaining + len(spec), budget)
                spec = spec[:max(0, num_new - 1)]
                if num_new > 1 and self.waiting and not decodes:
                    num_new = min(num_new, self._chunk_cap())
                while not self._allocate(seq, num_new, seq.num_computed_tokens):
                    if spec:  # proposed tokens go before anyone is preempted
                        spec, num_new = [], 1
                        continue
                    victim = self._victim()
                    budget += self._preempt(victim, out)
                    if victim is seq:
                        break
                else:
                    out.scheduled.append(ScheduledSequence(seq.seq_id, num_new, spec))
                    budget -= num_new

        # 2. Waiting sequences, unless this step had to preempt (memory is tight). A sequence of
        #    n > 1 samples forks when its prompt is done: its siblings count from admission.
        forks_pending = sum(s.num_forks_pending for s in self.running) if self.waiting else 0
        index = 0  # waiting sequences before it wait for a LoRA slot
        while index < len(self.waiting) and budget > 0 and not out.preempted_seq_ids:
            seq = self.waiting[index]
            if seq.lora_name is not None and not self.lora_slots.can_use(seq.lora_name):
                index += 1  # every slot serves running sequences of other adapters
                continue
            num_seqs_after = len(self.running) + len(self.loading) + forks_pending + 1 + seq.num_forks_pending
            if num_seqs_after > self.max_num_seqs:
                break
            # A prompt whose logprobs are asked for is computed in full: cached positions
            # would have no logits (vLLM does the same).
            swapped = seq.status == SequenceStatus.SWAPPED  # its computed tokens come back from host memory
            looked_up = self.block_manager.enable_prefix_caching and not seq.needs_prompt_logprobs and not swapped
            hit = self.block_manager.get_computed_blocks(seq) if looked_up else None
            num_hit = hit.num_tokens if hit is not None else seq.num_computed_tokens
            if seq.remote_prefill is not None and not seq.remote_prefill.admitted:
                if not self._admit_remote_prefill(seq, num_hit, hit):
                    break
                del self.waiting[index]
                continue
            num_new = seq.num_tokens - num_hit
            if len(self.waiting) > 1 and self.enable_chunked_prefill:
                num_new = min(num_new, self._chunk_cap())
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not self._allocate(seq, num_new, num_hit, hit):
                break
            del self.waiting[index]
            self._take_lora_slot(seq)
            if swapped:
                out.blocks_to_swap_in += self.swapper.swap_in(seq)
            if seq.num_output_tokens == 0 and seq.num_cached_tokens == 0 and not swapped:
                seq.num_cached_tokens = num_hit
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.time()
            seq.num_computed_tokens = num_hit
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            forks_pending += seq.num_forks_pending
            out.scheduled.append(ScheduledSequence(seq.seq_id, num_new))
            budget -= num_new

        out.block_copies = self.block_manager.take_copies()
        if self.host_tier is not None:
            out.blocks_to_swap_in += self.host_tier.take_copies_in()
        if self.host_pool is not None and not out.is_empty:
            out.blocks_to_swap_out = self.host_pool.take_copies_out()
        if self.lora_slots is not None:
            out.lora_loads = self.lora_slots.take_loads()
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        self._plan_samples(out)
        self.worker_view.describe(out, self.sequence)
        if not out.is_empty:  # (an empty step is not launched: they wait for the next)
            out.finished_seq_ids, self._stopped = self._stopped, []
        return out

    def _plan_samples(self, out: SchedulerOutput) -> None:
        """The rows the step samples: one for each sequence whose new tokens reach its end (and
        one for each sibling it forks into), one per position of a speculating sequence; and
        the prompt positions whose logprobs it computes."""
        for item in out.scheduled:
            seq = self.sequences[item.seq_id]
            if seq.needs_prompt_logprobs:
                # The rows of positions c..c+n-1 predict tokens c+1..c+n.
                c = seq.num_computed_tokens
                first = max(c + 1, seq.next_prompt_logprob)
                end = min(c + item.num_new_tokens + 1, seq.num_prompt_tokens)
                if first < end:
                    out.prompt_spans.append(PromptSpan(seq.seq_id, first, end))
            if item.spec_token_ids:
                # Its last token and each proposed one: a row per position, verified on arrival.
                k = len(item.spec_token_ids)
                out.spec_runs.append(SpecRun(seq.seq_id, item.spec_token_ids, len(out.sample_rows)))
                out.sample_rows.extend(SampleRow(seq.seq_id, seq.seq_id, k - j, d)
                                       for j, d in enumerate(item.spec_token_ids + [-1]))
                continue
            if seq.num_computed_tokens + item.num_new_tokens < seq.num_tokens:
                continue  # a prompt chunk that does not reach the end: nothing to sample
            out.sample_rows.append(SampleRow(seq.seq_id, seq.seq_id))
            if seq.num_forks_pending:
                children = [seq.fork(i) for i in range(1, seq.params.n)]
                self._forking.update((child.seq_id, child) for child in children)
                out.forks.append(Fork(seq.seq_id, [c.seq_id for c in children], [c.index for c in children]))
                out.sample_rows.extend(SampleRow(child.seq_id, seq.seq_id) for child in children)

    def _admit_remote_prefill(self, seq: Sequence, num_hit: int, hit) -> bool:
        """Blocks for the prompt but its last token, whose keys and values another engine
        computed: the part this engine's prefix cache lacks is read into them (outside the
        step's token budget); False when the blocks are not free."""
        remote = seq.remote_prefill
        end = max(num_hit, remote.num_tokens - 1)
        if not self.block_manager.allocate_slots(seq, end - num_hit, hit):
            return False
        remote.first_block, remote.end, remote.admitted = num_hit // self.block_manager.block_size, end, True
        seq.num_computed_tokens = seq.num_cached_tokens = num_hit
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.time()
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
        self.loading.append(seq)
        self._new_loads.append(seq)
        return True

    def _allocate(self, seq: Sequence, num_new: int, num_computed: int, hit=None) -> bool:
        """Slots for the step's tokens, and the lookahead when the sequence samples in this
        step and blocks are free for it."""
        lookahead = self.num_lookahead_tokens
        if lookahead and num_computed + num_new >= seq.num_tokens and \
                self.block_manager.allocate_slots(seq, num_new + lookahead, hit):
            return True
        return self.block_manager.allocate_slots(seq, num_new, hit)

    def _victim(self) -> Sequence:
        if self.policy == "priority":  # the last of the latest among the lowest priority
            return max(reversed(self.running), key=lambda s: (s.priority, s.arrival_time))
        return self.running[-1]

    def _chunk_cap(self) -> int:
        if not self.enable_chunked_prefill:
            return self.max_num_batched_tokens
        return self.long_prefill_token_threshold or max(1, self.max_num_batched_tokens // 2)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Free the sequence's blocks, for recompute or after swapping them out; returns the
        budget it gave back if it had already been scheduled in this step."""
        returned = 0
        for i, item in enumerate(out.scheduled):
            if item.seq_id == seq.seq_id:
                returned = item.num_new_tokens
                del out.scheduled[i]
                break
        self.running.remove(seq)
        self._drop_lora_slot(seq)
        if self.swapper is not None and self.swapper.should_swap(seq, self._chunk_cap()):
            self.swapper.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
        else:
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        if self.policy == "priority":
            self._insert_by_priority(seq)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted_seq_ids.append(seq.seq_id)
        self.worker_view.forget(seq.seq_id)
        self._stopped.append(seq.seq_id)
        return returned

    def update_after_step(self, out: SchedulerOutput) -> None:
        """The step is launched: its tokens count as computed (proposals only once verified),
        full blocks join the prefix cache, prompt logprobs are not computed again, and forked
        siblings join the running set sharing their parent's blocks."""
        for item in out.scheduled:
            seq = self.sequences[item.seq_id]
            seq.num_computed_tokens += item.num_known_tokens
            self.block_manager.cache_full_blocks(seq)
        for span in out.prompt_spans:
            self.sequences[span.seq_id].next_prompt_logprob = span.end
        for fork in out.forks:
            parent = self.sequences[fork.parent]
            parent.num_forks_pending = 0
            for child_id in fork.children:
                child = self._forking.pop(child_id)
                child.num_computed_tokens = parent.num_computed_tokens
                self.block_manager.fork(parent, child)
                self.add_running(child)
                self.worker_view.fork(parent.seq_id, child_id)

    @property
    def num_swapped(self) -> int:
        """Waiting sequences whose blocks are in host memory (preemption by swap)."""
        return self.swapper.num_swapped if self.swapper is not None else 0

    @property
    def num_waiting_unswapped(self) -> int:
        """Waiting sequences not swapped out (vLLM counts those apart)."""
        return len(self.waiting) - self.num_swapped

    def swap_stats(self) -> dict[str, float | int]:
        """The host pool's usage, preemption by swap's and the host tier's counters (none
        without a host pool)."""
        if self.host_pool is None:
            return {}
        stats: dict[str, float | int] = {"cpu_cache_usage": self.host_pool.usage}
        for part in (self.swapper, self.host_tier):
            if part is not None:
                stats.update(part.stats())
        return stats

    def num_wasted_slots(self) -> int:
        """Allocated KV slots not holding a computed token; under one block per sequence."""
        bs = self.block_manager.block_size
        return sum(len(s.block_table) * bs - s.num_computed_tokens for s in self.running)
