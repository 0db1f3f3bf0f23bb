"""An LLM frees itself when collected, shut down, or left as a context manager: its tensor-parallel
ranks (processes), rank 0's gloo process group, its threads and its tensors; then a new LLM,
tensor-parallel or not, starts in the same process and gives Hugging Face's greedy tokens."""
from __future__ import annotations

import gc
import threading
import weakref

import psutil
import pytest
import torch
import torch.distributed as dist
from hf_reference import hf_greedy_generate
from transformers import AutoModelForCausalLM, AutoTokenizer

from tritium import LLM, EngineShutdownError, SamplingParams

PROMPTS = ["The capital of France is", "The future of AI is"]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE_KWARGS = dict(dtype="float32", num_kv_blocks=64)


@pytest.fixture(scope="module")
def hf_tokens(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return hf_greedy_generate(model, [tok(p)["input_ids"] for p in PROMPTS], PARAMS.max_tokens)


def _generate(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS)]


def _snapshot() -> dict:
    return {"children": {c.pid for c in psutil.Process().children(recursive=True)},
            "threads": {t.ident for t in threading.enumerate()}}


def _left_behind(before: dict) -> dict:
    """What an LLM may leave in this process since `before`: child processes, Python threads
    (other tests' may end meanwhile: only new ones count), a process group."""
    now = _snapshot()
    return {"children": sorted(now["children"] - before["children"]),
            "threads": sorted(t.name for t in threading.enumerate() if t.ident not in before["threads"]),
            "process_group": dist.is_initialized()}


NOTHING = {"children": [], "threads": [], "process_group": False}


def test_a_collected_tensor_parallel_llm_frees_itself(tiny_model, hf_tokens):
    before = _snapshot()
    llm = LLM(tiny_model, tensor_parallel_size=2, **ENGINE_KWARGS)
    out1 = _generate(llm)
    assert out1 == hf_tokens
    ranks = [psutil.Process(pid) for pid in _left_behind(before)["children"]]
    assert len(ranks) == 1 and dist.is_initialized()
    engine, kv_cache = weakref.ref(llm.engine), weakref.ref(llm.engine.executor.worker.kv_cache)
    del llm
    gc.collect()
    assert engine() is None and kv_cache() is None  # its tensors are freed
    assert _left_behind(before) == NOTHING
    assert not ranks[0].is_running()  # stopped and reaped
    os_threads = psutil.Process().num_threads()

    llm = LLM(tiny_model, tensor_parallel_size=2, **ENGINE_KWARGS)
    assert _generate(llm) == out1
    del llm
    gc.collect()
    assert _left_behind(before) == NOTHING
    assert psutil.Process().num_threads() <= os_threads  # gloo's threads went with the group


def test_one_rank_then_two_ranks_in_one_process(tiny_model, hf_tokens):
    before = _snapshot()
    llm = LLM(tiny_model, **ENGINE_KWARGS)
    out1 = _generate(llm)
    del llm
    gc.collect()
    llm = LLM(tiny_model, tensor_parallel_size=2, **ENGINE_KWARGS)
    assert _generate(llm) == out1 == hf_tokens
    llm.shutdown()  # explicitly
    assert _left_behind(before) == NOTHING
    with pytest.raises(EngineShutdownError, match=r"^This LLM was shut down; create a new one\.$"):
        llm.generate(PROMPTS, PARAMS)
    llm.shutdown()  # again: nothing to do


def test_a_context_manager_frees_the_llm_at_its_end(tiny_model, hf_tokens):
    before = _snapshot()
    with LLM(tiny_model, tensor_parallel_size=2, **ENGINE_KWARGS) as llm:
        out1 = _generate(llm)
        assert _left_behind(before)["children"]  # its rank runs
    assert _left_behind(before) == NOTHING
    with LLM(tiny_model, tensor_parallel_size=2, **ENGINE_KWARGS) as llm:
        assert _generate(llm) == out1 == hf_tokens
    assert _left_behind(before) == NOTHING


def test_a_second_tensor_parallel_llm_while_one_lives_is_refused_and_leaves_it_serving(tiny_model, hf_tokens):
    """One tensor-parallel engine per process: the second's failed start must not take the
    first one's process group down with it."""
    with LLM(tiny_model, tensor_parallel_size=2, **ENGINE_KWARGS) as llm:
        with pytest.raises(RuntimeError, match="this process already serves a tensor-parallel model"):
            LLM(tiny_model, tensor_parallel_size=2, **ENGINE_KWARGS)
        gc.collect()
        assert _generate(llm) == hf_tokens
