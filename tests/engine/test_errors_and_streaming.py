"""Bad arguments fail with clear messages; the streaming engine keeps serving everyone else."""
from __future__ import annotations

import threading

import pytest

from tritium import LLM, EngineArgs, EngineShutdownError, SamplingParams, StreamingEngine
from tritium.engine.request import accumulate


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": -1}, "max_tokens must be at least 1, got -1."),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0."),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
    ({"temperature": -0.1}, "temperature must be non-negative, got -0.1."),
    ({"n": 0}, "n must be at least 1, got 0."),
    ({"top_k": -3}, "top_k must be -1 (disable) or at least 1, got -3."),
    ({"min_p": 2.0}, "min_p must be in [0, 1], got 2.0."),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 2], got 0.0."),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens must be less than or equal to max_tokens=2, got 5."),
    ({"logprobs": 50}, "logprobs must be in [0, 20], got 50."),
    ({"stop": [""]}, "stop must contain only non-empty strings, got ''."),
    ({"max_tokens": "8"}, "max_tokens must be of type int, got '8'."),
    ({"seed": 2**63}, "seed must be a 64-bit signed integer, in [-9223372036854775808, "
     "9223372036854775807], got 9223372036854775808."),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message


def test_sampling_params_from_json_values():
    p = SamplingParams.from_dict({"max_tokens": "256", "temperature": "0.5", "ignore_eos": "true",
                                  "stop": "###", "stop_token_ids": "[1, 2]", "seed": 3})
    assert (p.max_tokens, p.temperature, p.ignore_eos, p.stop, p.stop_token_ids, p.seed) == \
        (256, 0.5, True, ["###"], [1, 2], 3)
    with pytest.raises(ValueError, match="Unknown sampling parameter 'temprature'"):
        SamplingParams.from_dict({"temprature": 1})
    with pytest.raises(ValueError, match=r"sampling parameter 'max_tokens' must be an integer, got 'lots'."):
        SamplingParams.from_dict({"max_tokens": "lots"})


@pytest.mark.parametrize("kwargs, message", [
    ({"bogus": 1}, "Unknown engine argument 'bogus'."),
    ({"block_size": 12}, "block_size must be a power of two, got 12."),
    ({"dtype": "int8"}, "dtype must be one of auto, float32, bfloat16, float16; got 'int8'."),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1], got 1.5."),
    ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer, got 0."),
    ({"max_prefill_graph_tokens": -1}, "max_prefill_graph_tokens must be a non-negative integer, got -1."),
    ({"stream_interval": 0}, "stream_interval must be a positive integer, got 0."),
    ({"scheduling_policy": "sjf"}, "scheduling_policy must be one of fcfs, priority; got 'sjf'."),
    ({"max_model_len": 100000}, "max_model_len=100000 is larger than the model's max_position_embeddings=2048."),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64},
     "max_num_batched_tokens=64 is smaller than max_model_len=2048"),
    ({"device": "cuda"}, "device: cuda was requested but no CUDA device is available."),
])
def test_bad_engine_arguments(llama_dir, kwargs, message):
    if kwargs.get("device") == "cuda":
        import torch
        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
    with pytest.raises(ValueError) as info:
        LLM(llama_dir, **kwargs)
    assert str(info.value).startswith(message)


def test_bad_model_path():
    with pytest.raises(ValueError, match=r"model: directory '/nonexistent' does not exist."):
        EngineArgs(model="/nonexistent")


@pytest.fixture(scope="module")
def engine(llama_dir):
    eng = StreamingEngine(EngineArgs(model=llama_dir, max_model_len=64, num_kv_blocks=40))
    yield eng
    eng.shutdown()


class Collector:
    def __init__(self) -> None:
        self.total = None
        self.deltas = []
        self.done = threading.Event()

    def __call__(self, out) -> None:
        self.deltas.append(out)
        self.total = accumulate(self.total, out)
        if out.finished:
            self.done.set()


def test_bad_requests_fail_while_others_finish(engine):
    good = Collector()
    engine.add_request("good", [0, 1, 2, 3], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), good)
    cases = [
        ("", "The prompt is empty."),
        ([], "The prompt is empty."),
        (list(range(1, 70)), "The prompt has 69 tokens, but max_model_len is 64: prompt plus at least one generated token must fit."),
        ([0, 10**6], "Token id 1000000 is out of vocabulary"),
        ([0, -2, 1], "Token id -2 is out of vocabulary"),
        ([0, True], "Token id True is out of vocabulary"),
        ([3, 1.0], "Token id 1.0 is out of vocabulary"),
    ]
    for prompt, message in cases:
        with pytest.raises(ValueError) as info:
            engine.add_request("bad", prompt, SamplingParams(), Collector())
        assert str(info.value).startswith(message)
    with pytest.raises(ValueError, match="n=1000 is larger than max_num_seqs=256."):
        engine.add_request("bad", [1, 2], SamplingParams(n=1000), Collector())
    with pytest.raises(ValueError, match="Request id 'good' is already in use."):
        engine.add_request("good", [1, 2], SamplingParams(), Collector())
    assert good.done.wait(60)
    out = good.total.outputs[0]
    assert len(out.token_ids) == 30 and out.finish_reason == "length" and good.total.error is None
    assert sum(1 for d in good.deltas if d.finished) == 1


def test_prompt_larger_than_cache_is_rejected(llama_dir):
    eng = StreamingEngine(EngineArgs(model=llama_dir, num_kv_blocks=2, block_size=16))
    try:
        with pytest.raises(ValueError, match=r"The prompt has 40 tokens, more than the KV cache can ever hold \(32 tokens\)."):
            eng.add_request("x", list(range(40)), SamplingParams(), Collector())
    finally:
        eng.shutdown()


def test_concurrent_streams_abort_and_stats(engine):
    collectors = {f"r{i}": Collector() for i in range(12)}

    def submit(i: int) -> None:
        engine.add_request(f"r{i}", [0, i + 1, i + 2], SamplingParams(temperature=0.8, seed=i, max_tokens=20 + i,
                                                                      ignore_eos=True), collectors[f"r{i}"])

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.abort("r5")
    for rid, c in collectors.items():
        assert c.done.wait(60), rid
        finals = [d for d in c.deltas if d.finished]
        assert len(finals) == 1
    assert collectors["r5"].total.outputs[0].finish_reason in ("abort", "length")
    for i in (0, 11):
        assert len(collectors[f"r{i}"].total.outputs[0].token_ids) == 20 + i
    stats = engine.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    assert stats.generation_tokens >= 20 * 11 and stats.prompt_tokens >= 3 * 11
    assert sum(stats.request_success.values()) >= 12
    assert len(stats.time_to_first_token) >= 11 and len(stats.e2e_request_latency) >= 12
    assert len(stats.time_per_output_token) >= 11 and all(t >= 0 for t in stats.time_per_output_token)
    assert engine.get_stats().time_to_first_token == []  # samples are handed out once


def test_abort_long_request_frees_blocks(engine):
    c = Collector()
    engine.add_request("long", [0, 1], SamplingParams(max_tokens=60, ignore_eos=True), c)
    while not c.deltas:
        threading.Event().wait(0.01)
    engine.abort("long")
    assert c.done.wait(30)
    assert c.total.outputs[0].finish_reason == "abort"
    assert len(c.total.outputs[0].token_ids) < 60
    assert engine.get_stats().kv_cache_usage == 0.0


def test_shutdown_finishes_in_flight_requests_with_error(llama_dir):
    eng = StreamingEngine(EngineArgs(model=llama_dir))
    c = Collector()
    eng.add_request("x", [0, 1], SamplingParams(max_tokens=2000, ignore_eos=True), c)
    eng.shutdown()
    assert c.done.is_set()
    assert c.total.error == "The engine is shutting down."
    assert c.total.outputs[0].finish_reason == "abort"
    with pytest.raises(EngineShutdownError, match="The engine is shut down."):
        eng.add_request("y", [0, 1], SamplingParams(), Collector())


def test_idle_engine_keeps_no_reference_to_a_finished_request(engine):
    import gc
    import time
    import weakref

    c = Collector()
    ref = weakref.ref(c)
    engine.add_request("weak", [0, 1], SamplingParams(max_tokens=2, ignore_eos=True), c)
    assert c.done.wait(30)
    del c
    deadline = time.time() + 5
    while ref() is not None and time.time() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert ref() is None


@pytest.mark.parametrize("interval", [1, 4])
def test_stream_interval_groups_the_streamed_tokens(llama_dir, interval):
    """vLLM's stream_interval: the first token at once, then outputs of `interval` new tokens,
    and the rest with the finish; text and tokens add up to the output of an ungrouped stream.
    Every sample of n=2 counts on its own."""
    from tritium import EngineArgs, LLMEngine, SamplingParams
    from tritium.engine.request import accumulate
    engine = LLMEngine(EngineArgs(model=llama_dir, stream_interval=interval))
    engine.add_request("one", list(range(5, 25)), SamplingParams(temperature=0, max_tokens=11, ignore_eos=True))
    engine.add_request("two", list(range(30, 40)), SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6,
                                                                  ignore_eos=True))
    deltas = {"one": [], "two": []}
    totals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas[out.request_id].append([len(c.token_ids) for c in out.outputs])
            totals[out.request_id] = accumulate(totals.get(out.request_id), out)
    one = [d[0] for d in deltas["one"] if d[0]]
    assert one == ([1] * 11 if interval == 1 else [1, 4, 4, 2])
    assert deltas["two"][-1] and all(len(c.token_ids) == 6 for c in totals["two"].outputs)
    if interval == 4:  # both samples' first tokens at once, then 4, then the last one with the finish
        assert [d for d in deltas["two"] if any(d)] == [[1, 1], [4, 4], [1, 1]]
    reference = LLMEngine(EngineArgs(model=llama_dir))
    reference.add_request("one", list(range(5, 25)), SamplingParams(temperature=0, max_tokens=11, ignore_eos=True))
    want = None
    while reference.has_unfinished_requests():
        for out in reference.step():
            want = accumulate(want, out)
    assert totals["one"].outputs[0].token_ids == want.outputs[0].token_ids
    assert totals["one"].outputs[0].text == want.outputs[0].text


def test_stream_interval_sends_a_finished_sample_at_once(llama_dir):
    """With n=2, a sample that stops early goes out (with its finish) in the step it finishes,
    not when its sibling reaches the interval."""
    from tritium import EngineArgs, LLMEngine, SamplingParams
    prompt = list(range(30, 40))

    def run(interval: int, **extra) -> list[tuple[int, list[int], list]]:
        engine = LLMEngine(EngineArgs(model=llama_dir, stream_interval=interval))
        engine.add_request("r", prompt, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12,
                                                       ignore_eos=True, **extra))
        steps, step = [], 0
        while engine.has_unfinished_requests():
            step += 1
            for out in engine.step():
                steps.append((step, [c.token_ids for c in out.outputs], [c.finish_reason for c in out.outputs]))
        return steps

    free = run(1)
    sample0 = [t for _, ids, _ in free for t in ids[0]]
    sample1 = {t for _, ids, _ in free for t in ids[1]}
    # A token of sample 0 that sample 1 never draws, at a count that is not an interval boundary.
    count = next(c for c in range(2, 9) if (c - 1) % 4 and sample0[c - 1] not in sample1
                 and sample0[c - 1] not in sample0[:c - 1])
    stop = {"stop_token_ids": [sample0[count - 1]]}
    finish_step = {interval: next(step for step, _, reasons in run(interval, **stop) if reasons[0] == "stop")
                   for interval in (1, 4)}
    assert finish_step[4] == finish_step[1]
    grouped = run(4, **stop)
    assert sum(len(ids[0]) for _, ids, _ in grouped) == count
    assert sum(len(ids[1]) for _, ids, _ in grouped) == 12


def test_priority_scheduling_through_the_llm_api(llama_dir):
    """scheduling_policy="priority": with one sequence at a time, requests run in priority order
    (lower first), not in submission order; an fcfs engine refuses a priority."""
    from tritium import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [list(range(5, 15)), list(range(20, 30)), list(range(40, 50))]
    with pytest.raises(ValueError) as info:
        LLM(llama_dir).generate(prompts[:1], params, priority=[1])
    assert str(info.value) == ("Got priority 1, but the engine's scheduling_policy is 'fcfs'; "
                               "priorities need scheduling_policy='priority'.")
    llm = LLM(llama_dir, scheduling_policy="priority", max_num_seqs=1)
    with pytest.raises(ValueError, match=r"^priority must be an integer, got 'high'\.$"):
        llm.generate(prompts[:1], params, priority=["high"])
    outs = llm.generate(prompts, params, priority=[2, 0, 1])
    first = [o.metrics.first_token_time for o in outs]
    assert first[1] < first[2] < first[0]
    plain = LLM(llama_dir).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
