"""Tensor parallelism on the CPU (gloo, float32): tensor_parallel_size 2 and 4 give Hugging
Face's greedy tokens and tensor_parallel_size=1's tokens and logprobs, with chunked prefill,
prefix-cache hits, preemption, n > 1, LoRA, seeded sampling and a guided request; a rank that
dies fails every request once, and a new engine serves again."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from hf_reference import hf_greedy_generate
from lora_adapters import merged_hf_model, write_adapter
from test_hf_parity import hf_greedy, make_prompts, run_staggered
from transformers import AutoTokenizer

from tritium import LLM, EngineArgs, LLMEngine, SamplingParams, StreamingEngine
from tritium.worker.worker_group import check_tp_shapes

CHOICES = ["yes", "no", "maybe so"]


@pytest.fixture(scope="module")
def parity(llama_dir, qwen2_dir):
    refs = {}
    for name, model_dir in (("llama", llama_dir), ("qwen2", qwen2_dir)):
        prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir))
        refs[name] = (model_dir, prompts, hf_greedy(model_dir, prompts))
    return refs


# Llama: 4 query / 2 kv heads (tp=4 replicates each kv head on two ranks); Qwen2: 4 / 1
# (replicated on every rank), qkv bias, tied embeddings, a sharded checkpoint.
# `make test` runs Qwen2 on two ranks (its one kv head replicated, its bias, tied embeddings and
# shards); the other three pairs run under `make test-long`: four ranks on a two-core machine
# cost minutes, and test_mixed_batch_matches_one_rank_and_hf runs Llama on two and four ranks.
@pytest.mark.parametrize("name,tp", [pytest.param("llama", 2, marks=pytest.mark.long), ("qwen2", 2),
                                     pytest.param("llama", 4, marks=pytest.mark.long),
                                     pytest.param("qwen2", 4, marks=pytest.mark.long)])
def test_matches_hf_under_chunking_prefix_hits_and_preemption(parity, name, tp):
    model_dir, prompts, ref = parity[name]
    engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", max_num_batched_tokens=16,
                                  num_kv_blocks=24, block_size=16, enable_prefix_caching=True,
                                  tensor_parallel_size=tp))
    try:
        assert engine.executor.worker.attn_layers[0].num_kv_heads == 1
        got = run_staggered(engine, prompts)
        assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.prefix_cache_hits > 0
        for i in range(len(prompts)):
            assert got[str(i)] == ref[i], f"prompt {i} ({len(prompts[i])} tokens) differs from HF"
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def adapter(llama_dir, tmp_path_factory):
    return write_adapter(str(tmp_path_factory.mktemp("lora") / "all"), llama_dir,
                         ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                         8, 16, seed=5)


def _mixed_batch(llm: LLM):
    """Greedy with logprobs and prompt logprobs, n=2 seeded sampling, a guided request and a
    LoRA request, in one batch (a 32-token budget chunks the prompts next to the decodes)."""
    prompts = ["The cache streams a batch of tokens to every user",
               "A kernel decodes", "Choose one:", "The engine prefill block"]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, n=2, seed=7, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, structured_outputs={"choice": CHOICES}),
              SamplingParams(temperature=0, max_tokens=10, min_tokens=10)]
    return llm.generate(prompts, params, lora_request=[None, None, None, "all"])


def _engine_kwargs(adapter: str) -> dict:
    return dict(dtype="float32", max_num_batched_tokens=32, enable_lora=True,
                lora_modules={"all": adapter}, max_lora_rank=8)


@pytest.fixture(scope="module")
def one_rank(llama_dir, adapter):
    llm = LLM(llama_dir, **_engine_kwargs(adapter))
    return _mixed_batch(llm)


@pytest.mark.parametrize("tp", [2, 4])
def test_mixed_batch_matches_one_rank_and_hf(llama_dir, adapter, one_rank, tp):
    llm = LLM(llama_dir, tensor_parallel_size=tp, **_engine_kwargs(adapter))
    try:
        got = _mixed_batch(llm)
    finally:
        llm.shutdown()
    for want, have in zip(one_rank, got):
        assert [c.token_ids for c in have.outputs] == [c.token_ids for c in want.outputs]
    greedy, sampled, guided, lora = got
    for w, h in zip(one_rank[0].outputs[0].logprobs, greedy.outputs[0].logprobs):
        assert sorted(w) == sorted(h)
        for token in w:
            assert h[token].logprob == pytest.approx(w[token].logprob, abs=1e-4)
            assert h[token].rank == w[token].rank
    for w, h in zip(one_rank[0].prompt_logprobs[1:], greedy.prompt_logprobs[1:]):
        for token in w:
            assert h[token].logprob == pytest.approx(w[token].logprob, abs=1e-4)
    assert len(sampled.outputs) == 2 and sampled.outputs[0].token_ids != sampled.outputs[1].token_ids
    assert guided.outputs[0].text in CHOICES
    # The adapter's request is Hugging Face's greedy continuation with the adapter merged.
    want = hf_greedy_generate(merged_hf_model(llama_dir, adapter), [lora.prompt_token_ids], 10)[0]
    assert lora.outputs[0].token_ids == want


def test_shapes_that_do_not_split_are_refused(llama_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's num_attention_heads=4"):
        check_tp_shapes({"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64}, 3)
    with pytest.raises(ValueError, match="num_key_value_heads=6: one must divide the other"):
        check_tp_shapes({"num_attention_heads": 12, "num_key_value_heads": 6, "intermediate_size": 64}, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer, got 0"):
        EngineArgs(model=llama_dir, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="does not divide the model's num_attention_heads=4"):
        LLM(llama_dir, tensor_parallel_size=8)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_rank_that_dies_fails_every_request_once_and_a_new_engine_serves(llama_dir):
    engine = StreamingEngine(EngineArgs(model=llama_dir, dtype="float32", tensor_parallel_size=2,
                                        max_num_seqs=4))
    workers = engine.engine.executor.workers
    pids = [p.pid for p in workers.procs]
    finals: dict[str, list] = {}
    first_token = threading.Event()
    lock = threading.Lock()

    def on_output(out):
        first_token.set()
        if out.finished:
            with lock:
                finals.setdefault(out.request_id, []).append(out)

    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i in range(8):  # 4 run, 4 wait
        engine.add_request(str(i), "The engine streams tokens", params, on_output)
    assert first_token.wait(60)
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.time() + 60
    while len(finals) < 8 and time.time() < deadline:
        time.sleep(0.05)
    engine.shutdown()
    assert sorted(finals, key=int) == [str(i) for i in range(8)]
    for rid, outs in finals.items():
        assert len(outs) == 1, rid
        assert outs[0].error is not None and "tensor-parallel rank 1" in outs[0].error, outs[0].error
        assert "killed by signal 9" in outs[0].error
    assert not any(_alive(pid) for pid in pids)
    # A reload serves again.
    llm = LLM(llama_dir, dtype="float32", tensor_parallel_size=2)
    try:
        out = llm.generate(["The engine streams tokens"], SamplingParams(temperature=0, max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4
        new_pids = [p.pid for p in llm.engine.executor.workers.procs]
    finally:
        llm.shutdown()
    assert not any(_alive(pid) for pid in new_pids)


# Loaded by every Python process started with it on PYTHONPATH: rank 1's Worker cannot be built.
_FAILING_RANK_1 = """
from tritium.worker.worker import Worker
_build = Worker.__init__
def _init(self, config, rank=0, link=None):
    if rank == 1:
        raise RuntimeError("injected start-up failure")
    _build(self, config, rank, link)
Worker.__init__ = _init
"""


def test_a_rank_that_fails_at_start_up_fails_the_load_with_its_error(llama_dir, monkeypatch, tmp_path):
    # Rank 1 fails after joining the group, while rank 0 builds its shard: rank 1's error.
    (tmp_path / "sitecustomize.py").write_text(_FAILING_RANK_1)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 failed: RuntimeError: injected start-up failure"):
        LLM(llama_dir, dtype="float32", tensor_parallel_size=2)


def test_fp8_kv_cache_and_speculative_decoding_match_one_rank(llama_dir):
    prompts = ["the cache block the cache block the cache", "A kernel decodes a kernel decodes"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kwargs = dict(dtype="float32", kv_cache_dtype="fp8", k_scale=0.05, v_scale=0.05,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                      "prompt_lookup_max": 3, "prompt_lookup_min": 2})
    want = [o.outputs[0].token_ids for o in LLM(llama_dir, **kwargs).generate(prompts, params)]
    llm = LLM(llama_dir, tensor_parallel_size=2, **kwargs)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.stats.spec_decode_num_drafts > 0
    finally:
        llm.shutdown()
    assert got == want


def test_dummy_weights_on_each_rank(llama_dir):
    llm = LLM(llama_dir, tensor_parallel_size=2, load_format="dummy", dtype="float32")
    try:
        out = llm.generate(["The engine"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 5
        shard = llm.engine.executor.worker.model.model.layers[0].self_attn.qkv_proj.weight
        assert shard.shape[0] == (4 + 2 * 2) * 16 // 2  # half of q, k, v's rows
    finally:
        llm.shutdown()
