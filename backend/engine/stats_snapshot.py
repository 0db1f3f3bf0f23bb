"""What LLMEngine.get_stats hands over: the counters the engine's parts keep in its EngineStats,
the scheduler's and the block manager's gauges now, and the latency samples since the previous
snapshot (taken: the next snapshot has only newer ones)."""
from __future__ import annotations

from ..core.block_manager import BlockManager
from ..core.scheduler import Scheduler
from .metrics import EngineStats


def snapshot_stats(stats: EngineStats, scheduler: Scheduler, block_manager: BlockManager,
                   transfer_stats: dict | None = None) -> EngineStats:
    s = stats
    snapshot = EngineStats(
        num_running=len(scheduler.running), num_waiting=scheduler.num_waiting_unswapped,
        kv_cache_usage=block_manager.usage,
        prefix_cache_queries=block_manager.prefix_cache_queries,
        prefix_cache_hits=block_manager.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions, prompt_tokens=s.prompt_tokens,
        generation_tokens=s.generation_tokens, request_success=dict(s.request_success),
        num_requests_rejected=s.num_requests_rejected, num_requests_timed_out=s.num_requests_timed_out,
        spec_decode_num_drafts=s.spec_decode_num_drafts, spec_decode_num_draft_tokens=s.spec_decode_num_draft_tokens,
        spec_decode_num_accepted_tokens=s.spec_decode_num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=list(s.spec_decode_num_accepted_tokens_per_pos),
        **_lora_stats(scheduler), **scheduler.swap_stats(), **(transfer_stats or {}), **{
            name: getattr(s, name) for name in EngineStats.SAMPLE_FIELDS})
    for name in EngineStats.SAMPLE_FIELDS:
        setattr(s, name, [])
    return snapshot


def _lora_stats(scheduler: Scheduler) -> dict:
    slots = scheduler.lora_slots
    if slots is None:
        return {}

    def names(seqs) -> str:
        return ",".join(sorted({s.lora_name for s in seqs if s.lora_name is not None}))
    return {"max_lora": len(slots.names), "running_lora_adapters": names(scheduler.running),
            "waiting_lora_adapters": names(scheduler.waiting)}
