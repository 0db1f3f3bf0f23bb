"""Under tensor parallelism every rank receives each step as the scheduler made it: the
`SchedulerOutput` itself (and the directories of adapters it loads), never a packed batch.
Each rank applies it to its own states and runs it; only rank 0 samples, so the other ranks
get each step's input ids from rank 0 by broadcast and adopt the scheduler's count after a
verification run. A workload that speculates (n-gram), forks n=2 samples, is preempted, asks
for prompt logprobs and uses a LoRA adapter gives exactly one rank's tokens over gloo."""
from __future__ import annotations

import pickle

import pytest
from lora_adapters import write_adapter

from tritium import EngineArgs, LLMEngine, LoRARequest, SamplingParams
from tritium.engine.request import accumulate
from tritium.step import (PLACEHOLDER, CachedSequenceData, NewSequenceData, SampleRow, ScheduledSequence,
                          SchedulerOutput, SpecRun)
from tritium.worker.request_states import RequestStates
from tritium.worker.worker_group import LogitsCall, StepCall, WorkerGroup

# Run by rank 1 at start-up (a sitecustomize): each message it unpickles from rank 0's pipe is
# logged by type, a step with its type and scheduled sequence ids.
_RANK_LOG = """
import pickle
_loads = pickle.loads

def _logged_loads(data, *args, **kwargs):
    message = _loads(data, *args, **kwargs)
    kind = type(message).__name__
    if kind in ("StepCall", "LogitsCall", "Stop"):
        step = getattr(message, "step", None)
        with open(LOG, "a") as f:
            f.write(kind + ("" if step is None else " " + type(step).__name__ + " " + ",".join(
                str(it.seq_id) for it in step.scheduled)) + "\\n")
    return message

pickle.loads = _logged_loads
"""

# Prompts that repeat themselves, so that n-gram speculation proposes tokens.
PROMPTS = [[1, 306, 466, 278, 71, 306, 466, 278], [1, 450, 86, 162, 231, 86, 162, 231],
           [1, 319, 208, 278, 208, 278, 208], [1, 13, 291, 13, 291, 13, 291, 13, 291]]


@pytest.fixture(scope="module")
def adapter(llama_dir, tmp_path_factory):
    return write_adapter(str(tmp_path_factory.mktemp("lora") / "qv"), llama_dir, ["q_proj", "v_proj"],
                         8, 16, seed=3)


def _engine_args(llama_dir: str, adapter: str, tp: int) -> EngineArgs:
    # Few KV blocks: the sequences outgrow them and are preempted (and later resumed whole).
    return EngineArgs(model=llama_dir, dtype="float32", tensor_parallel_size=tp, block_size=16,
                      num_kv_blocks=7, max_num_seqs=4, max_num_batched_tokens=32,
                      enable_prefix_caching=False, enable_lora=True, lora_modules={"qv": adapter},
                      max_lora_rank=8,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_max": 3, "prompt_lookup_min": 2})


def _run(engine: LLMEngine, adapter: str) -> dict[str, object]:
    greedy = dict(temperature=0, ignore_eos=True, max_tokens=40)
    requests = {
        "greedy": (PROMPTS[0], SamplingParams(**greedy), None),
        "lora": (PROMPTS[1], SamplingParams(**greedy), "qv"),
        # An adapter the request brings: rank 0 reads it, and the step that loads it into the
        # one slot (taking turns with "qv") tells the other ranks its directory.
        "dyn": (PROMPTS[1], SamplingParams(**greedy), LoRARequest("dyn", 1, adapter)),
        "n2": (PROMPTS[2], SamplingParams(temperature=0.8, top_p=0.9, n=2, seed=11, max_tokens=40,
                                          ignore_eos=True), None),
        "logprobs": (PROMPTS[3], SamplingParams(prompt_logprobs=2, **greedy), None),
    }
    results: dict[str, object] = {}
    for rid, (prompt, params, lora) in requests.items():
        engine.add_request(rid, prompt, params, lora_request=lora)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            results[delta.request_id] = accumulate(results.get(delta.request_id), delta)
    return results


def test_ranks_receive_the_scheduler_output_and_give_one_ranks_tokens(llama_dir, adapter, tmp_path,
                                                                       monkeypatch):
    want = _run(LLMEngine(_engine_args(llama_dir, adapter, 1)), adapter)
    rank_log = tmp_path / "rank1"
    (tmp_path / "sitecustomize.py").write_text(f"LOG = {str(rank_log)!r}\n" + _RANK_LOG)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    sent: list[tuple[object, bytes]] = []
    _send = WorkerGroup._send

    def _recorded_send(self, message):
        sent.append((message, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)))
        return _send(self, message)
    monkeypatch.setattr(WorkerGroup, "_send", _recorded_send)
    engine = LLMEngine(_engine_args(llama_dir, adapter, 2))
    launched: list[SchedulerOutput] = []
    execute = engine.executor.execute_model

    def _recorded_execute(step):
        launched.append(step)
        return execute(step)
    monkeypatch.setattr(engine.executor, "execute_model", _recorded_execute)
    try:
        got = _run(engine, adapter)
        assert engine.scheduler.num_preemptions > 0
        assert engine.stats.spec_decode_num_drafts > 0
    finally:
        engine.shutdown()

    # Exactly one rank's tokens, both samples of n=2, and its prompt logprobs.
    assert sorted(got) == sorted(want)
    for rid in want:
        assert [c.token_ids for c in got[rid].outputs] == [c.token_ids for c in want[rid].outputs], rid
    assert len(got["n2"].outputs) == 2
    for w, h in zip(want["logprobs"].prompt_logprobs[1:], got["logprobs"].prompt_logprobs[1:]):
        assert sorted(w) == sorted(h)
        for token in w:
            assert h[token].logprob == pytest.approx(w[token].logprob, abs=1e-4)

    # What the ranks received: each launched step, the scheduler's own object, once; then
    # LM-head calls. No packed batch and no array crossed the pipe.
    steps = [m for m, _ in sent if isinstance(m, StepCall)]
    assert [type(m) for m, _ in sent if not isinstance(m, StepCall)] == \
        [LogitsCall] * (len(sent) - len(steps))
    assert [call.step for call in steps] == launched and len(launched) > 10
    assert all(type(call.step) is SchedulerOutput for call in steps)
    assert any(call.step.spec_runs for call in steps) and any(call.step.forks for call in steps)
    assert any(call.step.preempted_seq_ids for call in steps) and any(call.step.prompt_spans for call in steps)
    loads = [call for call in steps if call.step.lora_loads]
    assert "dyn" in {name for call in loads for _, name in call.step.lora_loads}
    for call in loads:
        assert call.adapter_dirs == {name: adapter for _, name in call.step.lora_loads}
    for _, data in sent:
        for name in (b"PreparedBatch", b"ForwardCall", b"input_batch", b"numpy"):
            assert name not in data
    # Rank 1 handled those messages, in that order, then the Stop of the shutdown.
    logged = rank_log.read_text().splitlines()
    assert logged[-1] == "Stop"
    assert logged[:-1] == [f"StepCall SchedulerOutput {','.join(str(it.seq_id) for it in m.step.scheduled)}"
                      if isinstance(m, StepCall) else "LogitsCall" for m, _ in sent]


def test_a_rank_without_results_adopts_the_count_after_a_verification_run():
    params = SamplingParams(temperature=0)
    states = RequestStates(receives_results=False)
    new = NewSequenceData(7, 0, [1, 2, 3, 4], 3, params, [0], num_computed_tokens=3, lora_slot=-1)
    verify = SchedulerOutput(scheduled=[ScheduledSequence(7, 4, spec_token_ids=[5, 6, 7])],
                             new_sequences=[new], sample_rows=[SampleRow(7, 7, 3 - j, d)
                                                               for j, d in enumerate([5, 6, 7, -1])],
                             spec_runs=[SpecRun(7, [5, 6, 7], 0)])
    states.apply(verify)
    states.book_launch(verify, [states[7]] * 4)
    assert (states[7].num_computed_tokens, len(states[7].token_ids)) == (4, 4)
    # Two proposals accepted (known to rank 0 only): the scheduler counts 6, the next token is
    # the 7th, of unknown value here.
    states.apply(SchedulerOutput(scheduled=[ScheduledSequence(7, 1)],
                                 cached_sequences=[CachedSequenceData(7, 6, 1)]))
    assert states[7].num_computed_tokens == 6
    assert states[7].token_ids == [1, 2, 3, 4, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER]
    # Only after a verification run, and only within its proposals.
    with pytest.raises(RuntimeError, match="the scheduler counts 8 computed tokens of sequence 7, the worker 6"):
        states.apply(SchedulerOutput(cached_sequences=[CachedSequenceData(7, 8, 1)]))
    verify_again = SchedulerOutput(scheduled=[ScheduledSequence(7, 3, spec_token_ids=[8, 9])],
                                   cached_sequences=[CachedSequenceData(7, 6, 1)],
                                   spec_runs=[SpecRun(7, [8, 9], 0)])
    states.apply(verify_again)
    states.book_launch(verify_again, [states[7]] * 3)
    with pytest.raises(RuntimeError, match="counts 10 computed tokens of sequence 7 after a verification "
                                           "run of 2 proposals from 7"):
        states.apply(SchedulerOutput(cached_sequences=[CachedSequenceData(7, 10, 1)]))
