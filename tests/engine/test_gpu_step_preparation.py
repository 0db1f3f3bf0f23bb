"""The parts of the GPU step path that are plain Python, checked on the CPU: block-table padding,
the decode graphs' context buckets, and the start-up run of every eager kernel variant."""
from __future__ import annotations

import torch

from backend import EngineArgs, LLMEngine
from backend.cuda_graph import context_buckets
from backend.input_batch import prepare_batch
from backend.scheduler import ScheduledSequence
from backend.sampling_params import SamplingParams
from backend.sequence import Sequence


def test_block_tables_are_padded_to_a_multiple_of_16():
    items = []
    for i, (n, new) in enumerate([(40, 1), (17 * 16 + 3, 1), (50, 50)]):
        s = Sequence(str(i), list(range(n)), n, SamplingParams())
        s.block_table = list(range(100 * i, 100 * i + -(-n // 16)))
        s.num_computed_tokens = n - new
        items.append(ScheduledSequence(s, new))
    batch = prepare_batch(items, 16)
    assert batch.decode_block_tables.shape == (2, 32)  # 18 blocks, padded
    assert batch.decode_block_tables[1, :18].tolist() == list(range(100, 118))
    assert batch.decode_block_tables[1, 18:].tolist() == [0] * 14
    assert batch.prefill_block_tables.shape == (1, 16)  # 4 blocks, padded


def test_decode_graph_context_buckets():
    assert context_buckets(2048) == [2048]
    assert context_buckets(4096) == [4096]
    assert context_buckets(8192) == [4096, 8192]


def test_start_up_kernel_variants_run_on_any_pool(llama_dir, monkeypatch):
    engine = LLMEngine(EngineArgs(model=llama_dir, num_kv_blocks=8, max_num_seqs=4, max_model_len=128))
    props = type("Props", (), {"multi_processor_count": 132})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []
    forward = engine.runner._forward_eager
    monkeypatch.setattr(engine.runner, "_forward_eager", lambda batch: calls.append(batch) or forward(batch))
    engine.runner._compile_step_variants()  # 8 blocks: block ids wrap around the pool
    shapes = [(b.num_decodes, b.num_tokens - b.num_decodes) for b in calls]
    assert shapes == [(1, 0), (1, 0), (4, 0), (4, 0), (1, 16), (1, 32), (1, 64)]
    assert all(int(b.decode_block_tables.max()) < 8 for b in calls)
    assert engine.block_manager.usage == 0.0
