"""Start-up work on the GPU: sizing the KV cache by a memory profile, and compiling every
kernel variant a step can pick before serving starts (a compile mid-serving stalls a step)."""
from __future__ import annotations

import gc
import logging
from typing import Any, Callable, Protocol

import torch

from tritium import kernels

from ..engine_config import EngineConfig
from ..sampling_params import SamplingParams
from ..step import ScheduledSequence
from .host_kv_cache import staging_bytes
from .input_batch import prepare_batch
from .request_states import RequestState

logger = logging.getLogger(__name__)

_PROFILE_PARAMS = SamplingParams(max_tokens=1)


class StartupWorker(Protocol):
    """What the start-up work reads of the Worker being built (it is called from there): its
    model and cache, and its runner's eager forward pass and sampler."""
    config: EngineConfig
    device: torch.device
    model: Any
    runner: Any
    lora_manager: Any
    attn_layers: list
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    num_kv_heads: int
    num_blocks: int
    vocab_size: int
    cache_dtype: torch.dtype
    block_bytes: int
    allocate_cache: Callable[..., torch.Tensor]
    bind_cache: Callable[[torch.Tensor], None]


def scratch_state(seq_id: int, token_ids: list[int], block_table: list[int] | None = None,
                  params: SamplingParams = _PROFILE_PARAMS, lora_slot: int = -1) -> RequestState:
    """A sequence of scratch tokens over given blocks, for start-up passes."""
    return RequestState(seq_id, 0, token_ids, len(token_ids), params, block_table or [], 0, lora_slot)


@torch.inference_mode()
def profile_num_blocks(worker: StartupWorker) -> int:
    """Run a forward pass at the token budget, see the peak memory, give the rest of
    gpu_memory_utilization to the KV cache (less the swap copies' staging, with swap_space)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    free, total = torch.cuda.mem_get_info()
    others = total - free - torch.cuda.memory_reserved()  # other processes, CUDA context
    num_tokens = worker.max_num_batched_tokens
    seq_len = min(worker.max_model_len, num_tokens)
    lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    blocks_per_seq = -(-seq_len // worker.block_size)
    scratch = worker.allocate_cache(blocks_per_seq * len(lens), zero=False)
    worker.bind_cache(scratch)
    seqs, states = [], {}
    for j, n in enumerate(lens):
        s = states[-1 - j] = scratch_state(-1 - j, [0] * n, list(range(j * blocks_per_seq, (j + 1) * blocks_per_seq)))
        seqs.append(ScheduledSequence(s.seq_id, n))
    hidden = worker.runner.forward_eager(prepare_batch(seqs, states, worker.block_size))
    rows = min(worker.config.scheduler_config.max_num_seqs, num_tokens)
    logits = worker.model.compute_logits(hidden[:rows])
    torch.log_softmax(logits.float(), dim=-1).sort(dim=-1)  # the sampler's worst case
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del scratch, hidden, logits
    for layer in worker.attn_layers:
        layer.k_cache = layer.v_cache = None
    gc.collect()
    torch.cuda.empty_cache()
    staging = staging_bytes(worker.block_bytes) if worker.config.cache_config.swap_space else 0
    available = total * worker.config.cache_config.gpu_memory_utilization - others - peak - staging
    num_blocks = int(available // worker.block_bytes)
    logger.info("KV cache: %d blocks (%.2f GiB of %s); peak activation+weights %.2f GiB; swap staging %.2f GiB",
                num_blocks, num_blocks * worker.block_bytes / 2**30,
                str(worker.cache_dtype).removeprefix("torch."), peak / 2**30, staging / 2**30)
    if num_blocks < 1:
        raise ValueError("gpu_memory_utilization: no memory is left for the KV cache "
                         f"(weights and activations peak at {peak / 2**30:.2f} GiB of "
                         f"{total / 2**30:.2f} GiB); raise it or lower max_num_batched_tokens.")
    return num_blocks


@torch.inference_mode()
def compile_step_variants(worker: StartupWorker) -> None:
    """Run each attention-kernel variant an eager step can pick (decode: small- or full-batch
    tiles, with or without a KV split; prefill: 16/32/64-row tiles, with GQA heads packed for
    chunks of at most PACK_GQA_MAX_LEN tokens, and 128-row tiles for chunks over 1,024
    tokens), the LoRA expand's tile sizes, and the greedy sampler's
    kernel once now, so Triton compiles them at startup and not in the middle of serving
    (seconds each, first time on a machine; `CompileWatch` logs any that is left). Writes
    only scratch KV and outputs: no block holds cached data yet."""
    sms = torch.cuda.get_device_properties(worker.device).multi_processor_count
    full_batch = min(-(-sms // worker.num_kv_heads), worker.config.scheduler_config.max_num_seqs)
    short, long_ = 16, min(1024, worker.max_model_len)
    # (decodes, their context length, prompt-chunk tokens alongside)
    cases = [(1, short, 0), (1, long_, 0), (full_batch, short, 0), (full_batch, long_, 0)]
    from tritium.kernels.prefill_attention import PACK_GQA_MAX_LEN
    group = worker.attn_layers[0].num_heads // worker.num_kv_heads
    # Short chunks pack `group` heads' rows into 16-, 32- or 64-row tiles.
    packed = {min(PACK_GQA_MAX_LEN, max(1, rows // group)) for rows in (16, 32, 64)} if group > 1 else set()
    cases += [(1, short, n) for n in sorted({16, 32, 64, 1040} | packed)
              if n <= min(worker.max_model_len, worker.max_num_batched_tokens)]
    lora = worker.lora_manager is not None
    next_block = 0

    states: dict[int, RequestState] = {}

    def fake(n: int) -> RequestState:
        nonlocal next_block
        blocks = -(-n // worker.block_size)
        # LoRA slot 0's delta goes into the discarded output.
        s = states[-1 - next_block] = scratch_state(
            -1 - next_block, [0] * n, [(next_block + i) % worker.num_blocks for i in range(blocks)],
            lora_slot=0 if lora else -1)
        next_block += blocks
        return s

    for decodes, context, chunk in cases:
        items = []
        for _ in range(decodes):
            s = fake(context)
            s.num_computed_tokens = context - 1
            items.append(ScheduledSequence(s.seq_id, 1))
        if chunk:
            items.append(ScheduledSequence(fake(chunk).seq_id, chunk))
        hidden = worker.runner.forward_eager(prepare_batch(items, states, worker.block_size, lora=lora))
    # The greedy sampler's kernel (the memory profile samples at temperature 1).
    greedy = scratch_state(-1, [0], params=SamplingParams(temperature=0, max_tokens=1))
    worker.runner.sampler(worker.model.compute_logits(hidden[-2:]), [greedy, greedy])
    # The penalties' kernel, each variant: all rows or some; repetition, additive or both
    # (it reads slot 0's counts, still zero, and writes scratch logits).
    counts = worker.runner.sampler.counts
    logits = torch.zeros((2, worker.vocab_size), dtype=torch.float32, device=worker.device)
    two = torch.zeros(2, dtype=torch.int64, device=worker.device)
    ones = torch.ones(2, dtype=torch.float32, device=worker.device)
    for rows in (None, two):
        for rep, add in ((ones, ones), (ones, None), (None, ones)):
            kernels.apply_penalties(logits, rows, two, counts.output_counts, counts.in_prompt, rep, add, add)
    torch.cuda.synchronize()
