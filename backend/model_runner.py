"""ModelRunner: owns the model, the KV cache pool and the sampler; runs one scheduled step."""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from kernels.validation import v_cache_shape

from .compile_watch import CompileWatch
from .config import CPU_KV_CACHE_BYTES, EngineArgs
from .cuda_graph import SPEC_GRAPH_MAX_SEQS, DecodeGraphs, PrefillGraphs
from .forward_context import LoRAMapping, set_attention_metadata, set_lora_mapping
from .input_batch import DecodeBlockRows, prepare_batch
from .layers import ops
from .layers.attention import Attention
from .layers.int4 import INT4_METHODS
from .layers.quantization import check_fp8_supported, get_linear_method, process_weights_after_loading
from .layers.penalties import PenaltyCounts
from .layers.sampler import PromptLogprobsOutput, Sampler, SamplerOutput, compute_prompt_logprobs
from .loader import load_dummy, load_safetensors
from .lora import LoRAManager
from .models import get_model_class
from .sampling_params import SamplingParams
from .scheduler import ScheduledSequence
from .sequence import PLACEHOLDER, Sequence

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(args: EngineArgs) -> torch.device:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was requested but no CUDA device is available.")
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def resolve_dtype(args: EngineArgs, hf_config: dict, device: torch.device) -> torch.dtype:
    if args.dtype != "auto":
        return _DTYPES[args.dtype]
    if device.type == "cpu":
        return torch.float32  # CPU bf16 matmuls are slow and inexact; tests compare in float32
    config_dtype = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16")
    return _DTYPES.get(config_dtype, torch.bfloat16) if config_dtype != "float32" else torch.bfloat16


def resolve_quantization(args: EngineArgs, hf_config: dict) -> str | None:
    """`quantization`, or what the checkpoint's config.json declares, as vLLM reads it: an FP8
    checkpoint (quant_method "fp8", or "compressed-tensors" with 8-bit float weights) is served
    in FP8, an AWQ or GPTQ one with its own packed weights. Other quantized formats are refused
    here rather than failing in the loader."""
    declared = hf_config.get("quantization_config")
    method = str((declared or {}).get("quant_method", "")).lower()
    if method in INT4_METHODS and args.quantization not in (None, method):
        raise ValueError(f"quantization={args.quantization!r}, but the checkpoint is quantized "
                         f"with {method!r}: leave quantization unset or set it to {method!r}")
    if args.quantization in INT4_METHODS and method != args.quantization and args.load_format != "dummy":
        raise ValueError(f"quantization={args.quantization!r} reads {args.quantization.upper()} "
                         f"checkpoints (their config.json declares it in quantization_config); "
                         f"for random weights use load_format=dummy")
    if not declared or args.quantization is not None:
        return args.quantization
    if method in INT4_METHODS:
        logger.info("The checkpoint is %s: serving its packed weights with quantization=%s",
                    method.upper(), method)
        return method
    groups = list((declared.get("config_groups") or {}).values())
    fp8_weights = all(isinstance(g, dict) and (g.get("weights") or {}).get("type") == "float"
                      and (g.get("weights") or {}).get("num_bits") == 8 for g in groups)
    if method == "fp8" or (method == "compressed-tensors" and groups and fp8_weights):
        logger.info("The checkpoint is FP8 (quant_method %r): serving it with quantization=fp8", method)
        return "fp8"
    raise ValueError(f"model: the checkpoint is quantized with {method or declared!r}, which "
                     f"Tritium does not read; FP8 (quant_method 'fp8' or FP8 compressed-tensors), "
                     f"AWQ and GPTQ checkpoints are supported")


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None  # requested top logprobs: (token id, logprob)
    rank: int | None


class ModelRunner:
    def __init__(self, args: EngineArgs, hf_config: dict, max_model_len: int,
                 max_num_batched_tokens: int) -> None:
        self.args = args
        self.device = resolve_device(args)
        self.dtype = resolve_dtype(args, hf_config, self.device)
        self.block_size = args.block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            CompileWatch.remove_hooks()  # another engine's watch must not count this start-up
        torch.manual_seed(args.seed)
        model_cls = get_model_class(hf_config)
        self.quantization = resolve_quantization(args, hf_config)
        linear_method = get_linear_method(self.quantization, hf_config.get("quantization_config"))
        if self.quantization == "fp8":
            check_fp8_supported(self.device)
        self.cache_dtype = self.dtype if args.kv_cache_dtype == "auto" else torch.float8_e4m3fn
        if args.kv_cache_dtype != "auto":
            check_fp8_supported(self.device, f"kv_cache_dtype='{args.kv_cache_dtype}'")
        with torch.device(self.device):
            self.model = model_cls(hf_config, self.dtype, linear_method, max_model_len=max_model_len)
        self.model.eval()
        checkpoint_kv_scales: dict[str, dict[str, float]] = {}
        if args.load_format == "dummy":
            load_dummy(self.model, args.seed)
        else:
            checkpoint_kv_scales = load_safetensors(self.model, args.model)
        process_weights_after_loading(self.model)
        # LoRA adapters before the memory profile, so the cache is sized around them.
        self.lora_manager = LoRAManager(self.model, args.lora_modules, args.max_loras, args.max_lora_rank,
                                        self.dtype, self.device, args.max_cpu_loras) if args.enable_lora else None
        self.attn_layers = self.model.attention_layers()
        a = self.model.args
        self.num_kv_heads = self.attn_layers[0].num_kv_heads
        self.head_dim = a.head_dim
        self.vocab_size = a.vocab_size
        # Penalties' token counts stay on the device, a slot per running sequence; allocated
        # before the memory profile, so the cache is sized around them.
        self.sampler = Sampler(PenaltyCounts(args.max_num_seqs, self.vocab_size, self.device, max_model_len))
        self.decode_rows = DecodeBlockRows()  # decode rows' block tables, kept across steps
        # Prompt logprobs take the logits of this many rows at a time: the rows the memory
        # profile gives the sampler (`_profile_num_blocks`), so they fit in what the cache left.
        self.logits_rows_per_pass = max(1, min(args.max_num_seqs, max_num_batched_tokens))
        self.num_blocks = self._decide_num_blocks()
        self.kv_cache = self._allocate_cache(self.num_blocks, zero=True)
        self._bind_cache(self.kv_cache)
        self._set_kv_scales(args, checkpoint_kv_scales)
        if self.device.type == "cuda":
            self._compile_step_variants()
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.verify_graphs: PrefillGraphs | None = None  # speculative decoding's verification steps
        if self.device.type == "cuda" and not args.enforce_eager:
            max_blocks = -(-max_model_len // self.block_size)
            lora = self.lora_manager is not None
            self.graphs = DecodeGraphs(self.model, args.max_num_seqs, max_blocks, max_model_len, self.device, lora)
            self.graphs.capture()
            prefill_tokens = min(args.max_prefill_graph_tokens, max_num_batched_tokens)
            if prefill_tokens:
                self.prefill_graphs = PrefillGraphs(self.model, prefill_tokens, max_blocks, self.device,
                                                    lora=lora)
                self.prefill_graphs.capture()
            spec = args.speculative
            if spec:  # each of up to `seqs` sequences verifies its last token and k proposals
                rows = spec.num_speculative_tokens + 1
                seqs = min(args.max_num_seqs, SPEC_GRAPH_MAX_SEQS)
                self.verify_graphs = PrefillGraphs(self.model, min(seqs * rows, max_num_batched_tokens),
                                                   max_blocks, self.device, lora=lora, rows_per_seq=rows,
                                                   max_seqs=seqs, max_chunk=rows)
                self.verify_graphs.capture()
        # From here on a Triton compile stalls a step: log each one (kernels the warm-up missed).
        self.compile_watch = CompileWatch()
        if self.device.type == "cuda":
            self.compile_watch.install()

    def _set_kv_scales(self, args: EngineArgs, checkpoint: dict[str, dict[str, float]]) -> None:
        """An FP8 cache stores keys and values divided by per-layer scales: the checkpoint's
        where it has them (FP8 checkpoints calibrated them), else k_scale / v_scale."""
        for layer in self.attn_layers:
            layer.k_scale, layer.v_scale = float(args.k_scale), float(args.v_scale)
        if not checkpoint:
            return
        if self.cache_dtype != torch.float8_e4m3fn:
            logger.info("The checkpoint's KV cache scales (%d layers) are not used: "
                        "kv_cache_dtype is %s", len(checkpoint), args.kv_cache_dtype)
            return
        blocks = {name: module.attn for name, module in self.model.named_modules()
                  if isinstance(getattr(module, "attn", None), Attention)}
        for block, scales in sorted(checkpoint.items()):
            attn = blocks.get(block)
            if attn is None:
                raise ValueError(f"model: KV cache scales for {block!r}, which is not an "
                                 f"attention block of this model")
            attn.k_scale = scales.get("k", attn.k_scale)
            attn.v_scale = scales.get("v", attn.v_scale)
        logger.info("KV cache scales from the checkpoint for %d of %d layers", len(checkpoint),
                    len(self.attn_layers))

    # ---- KV pool sizing -----------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        return (2 * len(self.attn_layers) * self.block_size * self.num_kv_heads * self.head_dim
                * self.cache_dtype.itemsize)

    def _allocate_cache(self, num_blocks: int, zero: bool) -> torch.Tensor:
        """[2, layers, num_blocks, block_size, Hkv, D] in the cache dtype. Made as bytes and
        reinterpreted, since not every device fills or indexes float8 tensors."""
        shape = (2, len(self.attn_layers), num_blocks, self.block_size, self.num_kv_heads,
                 self.head_dim)
        make = torch.zeros if zero else torch.empty
        raw = make(*shape[:-1], self.head_dim * self.cache_dtype.itemsize, dtype=torch.uint8,
                   device=self.device)
        return raw.view(self.cache_dtype)

    def _bind_cache(self, pool: torch.Tensor) -> None:
        """Give each attention layer its views of the pool; an FP8 value cache is each block
        transposed, [num_blocks, Hkv, D, block_size] (same bytes per block)."""
        for i, layer in enumerate(self.attn_layers):
            k_cache = pool[0, i]
            layer.k_cache = k_cache
            layer.v_cache = pool[1, i].view(v_cache_shape(tuple(k_cache.shape), pool.dtype))

    def _decide_num_blocks(self) -> int:
        if self.args.num_kv_blocks is not None:
            return self.args.num_kv_blocks
        if self.device.type == "cpu":
            enough = -(-self.max_model_len // self.block_size) * self.args.max_num_seqs
            return max(1, min(CPU_KV_CACHE_BYTES // self.block_bytes, enough))
        return self._profile_num_blocks()

    @torch.inference_mode()
    def _profile_num_blocks(self) -> int:
        """Run a forward pass at the token budget, see the peak memory, give the rest of
        gpu_memory_utilization to the KV cache."""
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        free, total = torch.cuda.mem_get_info()
        others = total - free - torch.cuda.memory_reserved()  # other processes, CUDA context
        num_tokens = self.max_num_batched_tokens
        seq_len = min(self.max_model_len, num_tokens)
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        blocks_per_seq = -(-seq_len // self.block_size)
        scratch = self._allocate_cache(blocks_per_seq * len(lens), zero=False)
        self._bind_cache(scratch)
        seqs = []
        for j, n in enumerate(lens):
            s = Sequence(f"profile-{j}", [0] * n, n, _PROFILE_PARAMS)
            s.block_table = list(range(j * blocks_per_seq, (j + 1) * blocks_per_seq))
            seqs.append(ScheduledSequence(s, n))
        hidden = self._forward_eager(prepare_batch(seqs, self.block_size))
        rows = min(self.args.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:rows])
        torch.log_softmax(logits.float(), dim=-1).sort(dim=-1)  # the sampler's worst case
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del scratch, hidden, logits
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = None
        gc.collect()
        torch.cuda.empty_cache()
        available = total * self.args.gpu_memory_utilization - others - peak
        num_blocks = int(available // self.block_bytes)
        logger.info("KV cache: %d blocks (%.2f GiB of %s); peak activation+weights %.2f GiB",
                    num_blocks, num_blocks * self.block_bytes / 2**30,
                    str(self.cache_dtype).removeprefix("torch."), peak / 2**30)
        if num_blocks < 1:
            raise ValueError("gpu_memory_utilization: no memory is left for the KV cache "
                             f"(weights and activations peak at {peak / 2**30:.2f} GiB of "
                             f"{total / 2**30:.2f} GiB); raise it or lower max_num_batched_tokens.")
        return num_blocks

    @torch.inference_mode()
    def _compile_step_variants(self) -> None:
        """Run each attention-kernel variant an eager step can pick (decode: small- or full-batch
        tiles, with or without a KV split; prefill: 16/32/64-row tiles, with GQA heads packed for
        chunks of at most PACK_GQA_MAX_LEN tokens, and 128-row tiles for chunks over 1,024
        tokens), the LoRA expand's tile sizes, and the greedy sampler's
        kernel once now, so Triton compiles them at startup and not in the middle of serving
        (seconds each, first time on a machine; `CompileWatch` logs any that is left). Writes
        only scratch KV and outputs: no block holds cached data yet."""
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        full_batch = min(-(-sms // self.num_kv_heads), self.args.max_num_seqs)
        short, long_ = 16, min(1024, self.max_model_len)
        # (decodes, their context length, prompt-chunk tokens alongside)
        cases = [(1, short, 0), (1, long_, 0), (full_batch, short, 0), (full_batch, long_, 0)]
        from kernels.prefill_attention import PACK_GQA_MAX_LEN
        group = self.attn_layers[0].num_heads // self.num_kv_heads
        # Short chunks pack `group` heads' rows into 16-, 32- or 64-row tiles.
        packed = {min(PACK_GQA_MAX_LEN, max(1, rows // group)) for rows in (16, 32, 64)} if group > 1 else set()
        cases += [(1, short, n) for n in sorted({16, 32, 64, 1040} | packed)
                  if n <= min(self.max_model_len, self.max_num_batched_tokens)]
        lora = self.lora_manager is not None
        next_block = 0

        def fake(n: int) -> Sequence:
            nonlocal next_block
            s = Sequence("warm-up", [0] * n, n, _PROFILE_PARAMS)
            s.lora_slot = 0 if lora else -1  # slot 0's delta goes into the discarded output
            blocks = -(-n // self.block_size)
            s.block_table = [(next_block + i) % self.num_blocks for i in range(blocks)]
            next_block += blocks
            return s

        for decodes, context, chunk in cases:
            items = []
            for _ in range(decodes):
                s = fake(context)
                s.num_computed_tokens = context - 1
                items.append(ScheduledSequence(s, 1))
            if chunk:
                items.append(ScheduledSequence(fake(chunk), chunk))
            hidden = self._forward_eager(prepare_batch(items, self.block_size, lora=lora))
        # The greedy sampler's kernel (the memory profile samples at temperature 1).
        greedy = Sequence("warm-up", [0], 1, SamplingParams(temperature=0, max_tokens=1))
        self.sampler(self.model.compute_logits(hidden[-2:]), [greedy, greedy])
        # The penalties' kernel, each variant: all rows or some; repetition, additive or both
        # (it reads slot 0's counts, still zero, and writes scratch logits).
        counts = self.sampler.counts
        logits = torch.zeros((2, self.vocab_size), dtype=torch.float32, device=self.device)
        two = torch.zeros(2, dtype=torch.int64, device=self.device)
        ones = torch.ones(2, dtype=torch.float32, device=self.device)
        for rows in (None, two):
            for rep, add in ((ones, ones), (ones, None), (None, ones)):
                ops.apply_penalties(logits, rows, two, counts.output_counts, counts.in_prompt, rep, add, add)
        torch.cuda.synchronize()

    # ---- one step -----------------------------------------------------------------------------
    def _forward_eager(self, batch, fill=None, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        input_ids = self.to_device(batch.input_ids, torch.int64)
        if fill is not None:
            input_ids[fill[0]] = fill[2][fill[1]]
        positions = self.to_device(batch.positions, torch.int64)
        lora = None if batch.lora_slots is None else LoRAMapping(self.to_device(batch.lora_slots, torch.int64))
        with set_attention_metadata(batch.attention_metadata(self.to_device)), set_lora_mapping(lora):
            return self.model(input_ids, positions, logits_indices)

    def to_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        """Host data to the device without blocking: copies from pageable memory would wait
        for the stream (the step still running); pinned ones are queued behind it."""
        t = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return t.to(dtype)
        return t.to(dtype).pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledSequence], block_copies: list[tuple[int, int]],
               sample_rows: list[Sequence], sample_sources: list[int],
               previous: "PendingStep | None" = None,
               prompt_spans: list[tuple[ScheduledSequence, int, int]] = (),
               defer_sampling: bool = False, sample_offsets: list[int] | None = None,
               sample_drafts: list[int] | None = None) -> "PendingStep":
        """Queue the step on the device and return at once; `PendingStep.wait()` gives the
        sampled tokens. Row i of `sample_rows` samples from the logits after the last new token
        of the sequence with id `sample_sources[i]`. Input tokens still being sampled by
        `previous` (placeholders) are read from its output on the device. Each prompt span
        (scheduled item, first, end) asks for the logprobs of the item's prompt tokens
        first..end-1, which this step's rows predict (`PendingStep.prompt_results`).
        defer_sampling: queue only the forward pass; `sample()` queues the sampling later, once
        the host knows what it reads (the previous step's tokens, for a grammar).
        sample_offsets: row i samples that many rows before its sequence's last new token
        (speculative decoding verifies every proposed position); None: all from the last.
        sample_drafts: the proposed token row i verifies (-1: none), for rejection sampling."""
        if block_copies:
            src = self.to_device([c[0] for c in block_copies], torch.int64)
            dst = self.to_device([c[1] for c in block_copies], torch.int64)
            raw = self.kv_cache.view(torch.uint8)  # index_put has no float8 kernel on every device
            raw[:, :, dst] = raw[:, :, src]
        # A verification step of speculative decoding (rows before a sequence's last) of a few
        # sequences runs whole through the verification graphs, its decodes as one-token chunks.
        pg = self.verify_graphs
        verify_in_graph = (sample_offsets is not None and pg is not None and not prompt_spans
                           and len(scheduled) <= pg.max_seqs and len(sample_rows) <= pg.max_rows)
        batch = prepare_batch(scheduled, self.block_size, self.decode_rows, self.lora_manager is not None,
                              all_chunks=verify_in_graph)
        fill = None
        holes = np.flatnonzero(batch.input_ids == PLACEHOLDER)
        if len(holes):
            if previous is None or previous.token_ids is None:
                raise RuntimeError("a placeholder input token without a step that samples it")
            ids = batch.input_ids
            src_rows = [previous.row_of[sid] for sid in batch.seq_ids_at(holes)]
            ids[holes] = 0
            fill = (self.to_device(holes.astype(np.int64), torch.int64),
                    self.to_device(src_rows, torch.int64), previous.token_ids)
        # The packed row whose hidden state each sample row reads.
        rows_index = [batch.last_index[s] for s in sample_sources]
        if sample_offsets is not None:
            rows_index = [r - o for r, o in zip(rows_index, sample_offsets)]
        every_row = rows_index == list(range(batch.num_tokens))
        # The rows that predict prompt tokens whose logprobs are asked for (position j predicts
        # token j + 1), and those tokens.
        prompt_index: list[int] = []
        prompt_targets: list[int] = []
        for item, first, end in prompt_spans:
            seq = item.seq
            row_of_position_0 = batch.last_index[seq.seq_id] - (seq.num_computed_tokens + item.num_new_tokens - 1)
            prompt_index.extend(range(row_of_position_0 + first - 1, row_of_position_0 + end - 1))
            prompt_targets.extend(seq.token_ids[first:end])
        sampling = Sampler.prepare(sample_rows, self.vocab_size, self.device, counts=self.sampler.counts,
                                   drafts=sample_drafts) \
            if sample_rows and not defer_sampling else None
        gather = None
        prompt_hidden = None
        if self.graphs is not None and self.graphs.can_run(batch):
            if not every_row:
                gather = self.to_device(rows_index, torch.int64)
            hidden = self.graphs.run(batch, fill)  # every row
            if prompt_index:
                prompt_hidden = hidden[self.to_device(prompt_index, torch.int64)]
        elif verify_in_graph and fill is None and pg.can_run(batch):
            hidden = pg.run(batch, rows_index)  # the sampled rows, in order
        elif not prompt_index and sample_offsets is None and self.prefill_graphs is not None \
                and self.prefill_graphs.can_run(batch):
            # The graph gives the last row of each prompt chunk, in chunk order.
            chunk_of = {int(end) - 1: i for i, end in enumerate(batch.prefill_cu_seqlens_q[1:])}
            chunks = [chunk_of[r] for r in rows_index]
            if chunks != list(range(len(chunk_of))):
                gather = self.to_device(chunks, torch.int64)
            hidden = self.prefill_graphs.run(batch)  # prompt chunks have no placeholder tokens
        else:
            # Only the sampled rows (then the prompt-logprob rows) leave the last layer.
            logits_indices = None
            if not every_row or prompt_index:
                logits_indices = self.to_device(rows_index + prompt_index, torch.int64)
            hidden = self._forward_eager(batch, fill, logits_indices)
            if prompt_index:
                hidden, prompt_hidden = hidden[:len(rows_index)], hidden[len(rows_index):]
        prompt = None
        if prompt_index:
            num_top = max(item.seq.params.prompt_logprobs for item, _, _ in prompt_spans)
            prompt = compute_prompt_logprobs(
                self.model.compute_logits, prompt_hidden, self.to_device(prompt_targets, torch.int64),
                num_top, self.logits_rows_per_pass)
        spans = [(item.seq, first, end) for item, first, end in prompt_spans]
        ids = [s.seq_id for s in sample_rows]
        if not sample_rows:
            return PendingStep(None, sample_rows, ids, spans, prompt)
        if gather is not None:
            hidden = hidden[gather]
        if defer_sampling:
            # The graphs' output buffers stay valid: the next forward is queued after sample().
            pending = PendingStep(None, sample_rows, ids, spans, prompt, finish=False)
            pending.deferred_hidden = hidden
            return pending
        out = self.sampler(self.model.compute_logits(hidden), sample_rows, sampling)
        return PendingStep(out, sample_rows, ids, spans, prompt)

    @torch.inference_mode()
    def sample(self, pending: "PendingStep") -> None:
        """Queue the deferred sampling of a step launched with defer_sampling, from the rows'
        host state now: each row's tokens but its last (the placeholder of this very step)."""
        hidden, pending.deferred_hidden = pending.deferred_hidden, None
        sampling = Sampler.prepare(pending.rows, self.vocab_size, self.device, pending_tokens=1,
                                   counts=self.sampler.counts)
        pending.finish(self.sampler(self.model.compute_logits(hidden), pending.rows, sampling))


class PendingStep:
    """A launched step. The sampled tokens stay on the device (the next step reads them there)
    and travel to pinned host memory without blocking; `wait()` blocks on a CUDA event, which
    releases the GIL so that other threads (the server's response sender) run meanwhile."""

    def __init__(self, out: SamplerOutput | None, rows: list[Sequence], seq_ids: list[int],
                 prompt_spans: list[tuple[Sequence, int, int]] = (),
                 prompt: PromptLogprobsOutput | None = None, finish: bool = True) -> None:
        """finish=False: the sampling is deferred (ModelRunner.sample calls finish())."""
        self.rows = rows
        self.row_of = {sid: i for i, sid in enumerate(seq_ids)}
        self.positions: list[int] = []  # where each row's token goes (set by the engine)
        self.scheduled = None
        self.event = None
        self.waited_s = 0.0  # how long wait() blocked on the device
        self.deferred_hidden: torch.Tensor | None = None  # the rows' hidden states until sample()
        # (sequence, proposed tokens, its first row) of speculating sequences (set by the engine)
        self.spec: list[tuple[Sequence, list[int], int]] = []
        self.prompt_spans = list(prompt_spans) if prompt is not None else []
        # (sequence, first prompt position, a result per position from there), filled by wait()
        self.prompt_results: list[tuple[Sequence, int, list[SampleResult]]] = []
        self._prompt = prompt
        self.token_ids = self.host = self.prompt_host = None
        self.has_ranks = False
        if finish:
            self.finish(out)

    @property
    def deferred(self) -> bool:
        return self.deferred_hidden is not None

    def finish(self, out: SamplerOutput | None) -> None:
        """Start the copies of the sampled tokens (and prompt logprobs) to the host."""
        prompt, self._prompt = self._prompt, None
        self.token_ids = out.token_ids if out is not None else None
        on_device = []
        if out is not None:
            packed = [out.token_ids.double(), out.logprobs.double()]
            if out.ranks is not None:
                packed.append(out.ranks.double())
            self.host = [torch.stack(packed)] + [t for t in (out.top_logprobs, out.top_token_ids) if t is not None]
            self.has_ranks = out.ranks is not None
            on_device.append(self.host)
        if prompt is not None:
            self.prompt_host = [torch.stack([prompt.token_logprobs.double(), prompt.ranks.double()])]
            if prompt.top_logprobs is not None:
                self.prompt_host += [prompt.top_logprobs, prompt.top_token_ids]
            on_device.append(self.prompt_host)
        if on_device and on_device[0][0].is_cuda:
            for tensors in on_device:
                tensors[:] = [t.to("cpu", non_blocking=True) for t in tensors]
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> list[SampleResult]:
        if self.event is not None:
            start = time.perf_counter()
            self.event.synchronize()
            self.waited_s = time.perf_counter() - start
        if self.prompt_host is not None:
            self._take_prompt_logprobs()
        if self.host is None:
            return []
        main = self.host[0].tolist()
        token_ids, logprobs = main[0], main[1]
        ranks = main[2] if self.has_ranks else None
        top_vals = self.host[1].tolist() if len(self.host) > 1 else None
        top_ids = self.host[2].tolist() if len(self.host) > 2 else None
        results = []
        for i, row in enumerate(self.rows):
            k = row.params.logprobs
            top = None
            if k is not None:
                top = list(zip(top_ids[i][:k], top_vals[i][:k])) if k and top_ids else []
            results.append(SampleResult(int(token_ids[i]), logprobs[i], top,
                                        int(ranks[i]) if k is not None else None))
        return results

    def _take_prompt_logprobs(self) -> None:
        main = self.prompt_host[0].tolist()
        top_vals = self.prompt_host[1].tolist() if len(self.prompt_host) > 1 else None
        top_ids = self.prompt_host[2].tolist() if len(self.prompt_host) > 1 else None
        row = 0
        for seq, first, end in self.prompt_spans:
            k = seq.params.prompt_logprobs
            results = []
            for position in range(first, end):
                top = list(zip(top_ids[row][:k], top_vals[row][:k])) if k else None
                results.append(SampleResult(seq.token_ids[position], main[0][row], top, int(main[1][row])))
                row += 1
            self.prompt_results.append((seq, first, results))


_PROFILE_PARAMS = SamplingParams(max_tokens=1)
