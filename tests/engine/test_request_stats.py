"""vLLM V1's per-request statistics: one sample per finished request of its prompt and generated
tokens, its n and max_tokens, and the times it spent waiting, in prefill and in decode."""
from __future__ import annotations

import pytest

from tritium import EngineArgs, LLMEngine, SamplingParams


def test_per_request_samples(llama_dir):
    engine = LLMEngine(EngineArgs(model=llama_dir, dtype="float32", max_num_seqs=2, max_model_len=40))
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    engine.add_request("b", list(range(10, 19)), SamplingParams(n=2, seed=1, max_tokens=4, ignore_eos=True))
    engine.add_request("c", [7, 8, 9], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    engine.add_request("never", [7, 8], SamplingParams(max_tokens=3))
    engine.step()
    engine.abort_request("never")  # still waiting: it never ran
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    s = engine.get_stats()
    # a runs alone (b's two samples would make three), then b, then c; "never" was aborted waiting
    assert sorted(s.request_prompt_tokens) == [2, 3, 5, 9]
    assert sorted(s.request_generation_tokens) == [0, 7, 2 * 4, 40 - 3]
    assert sorted(s.request_params_n) == [1, 1, 1, 2]
    assert sorted(s.request_params_max_tokens) == [3, 4, 7, 40]  # max_model_len when unset
    # Timed only for requests that were scheduled: the aborted one has no phases.
    for name in ("request_queue_time", "request_prefill_time", "request_decode_time", "request_inference_time"):
        assert len(getattr(s, name)) == 3 and min(getattr(s, name)) >= 0, name
    for prefill, decode, inference in zip(s.request_prefill_time, s.request_decode_time, s.request_inference_time):
        assert inference == pytest.approx(prefill + decode, abs=1e-9)
    m = finished["c"].metrics
    assert m.first_scheduled_time - m.arrival_time == pytest.approx(max(s.request_queue_time), abs=1e-9)
    assert m.first_scheduled_time > finished["b"].metrics.first_scheduled_time > finished["a"].metrics.first_scheduled_time
    assert engine.get_stats().request_prompt_tokens == []  # samples are handed out once


def test_time_per_output_token_and_iteration_tokens_as_vllm_counts_them(llama_dir):
    """vLLM's inter-token latency: one sample per output token after the first (3 x 15 here),
    not one per request; iteration_tokens: per step, the prompt and generation tokens it added."""
    engine = LLMEngine(EngineArgs(model=llama_dir, dtype="float32", max_model_len=64))
    for i in range(3):
        engine.add_request(str(i), [1, 2, 3 + i], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    s = engine.get_stats()
    assert len(s.time_per_output_token) == 3 * 15 and min(s.time_per_output_token) > 0
    assert sum(s.iteration_tokens) == s.prompt_tokens + s.generation_tokens == 3 * 3 + 3 * 16
    assert min(s.iteration_tokens) > 0
