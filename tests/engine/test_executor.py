"""The executor seam: the engine drives one device (UniProcExecutor) or tensor-parallel ranks
(TensorParallelExecutor) through one surface, with Hugging Face's greedy tokens either way; and
under tensor parallelism every rank, given the step itself, runs its forward pass by the path
rank 0 takes (decode, prefill or verification graph, or eager). On the CPU the graphs are their
static buffers run eagerly (`Worker.build_graphs(capture=False)`), dispatched by the same code
that replays captured graphs on a GPU; with two GPUs the same test runs on captured graphs."""
from __future__ import annotations

import os

import pytest
import torch
from hf_reference import hf_greedy_generate
from transformers import AutoModelForCausalLM

from tritium import EngineArgs, LLMEngine, SamplingParams
from tritium.engine.request import accumulate
from tritium.worker.executor import TensorParallelExecutor, UniProcExecutor
from tritium.worker.forward_path import ForwardPath

# Prompts that repeat themselves, so that n-gram speculation proposes tokens.
PROMPTS = [[1, 306, 466, 278, 71, 306, 466, 278], [1, 450, 86, 162, 231, 86, 162],
           [1, 319, 208, 278, 208, 278, 208], [1, 13, 291, 13, 291, 13, 291, 13]]


def _generate(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    results: dict[str, object] = {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            results[delta.request_id] = accumulate(results.get(delta.request_id), delta)
    return {rid: out.outputs[0].token_ids for rid, out in results.items()}


@pytest.mark.parametrize("tp,kind", [(1, UniProcExecutor), (2, TensorParallelExecutor)])
def test_the_engine_drives_its_executor_and_gets_hf_greedy_tokens(llama_dir, tp, kind):
    want = hf_greedy_generate(AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32), PROMPTS, 12)
    engine = LLMEngine(EngineArgs(model=llama_dir, dtype="float32", tensor_parallel_size=tp,
                                  max_num_batched_tokens=16, num_kv_blocks=32))
    try:
        executor = engine.executor
        assert type(executor) is kind
        assert executor.num_blocks == 32 and engine.block_manager.num_blocks == 32
        assert executor.vocab_size == engine.vocab_size == 512
        # Rank 0's runner tells the other ranks its LM-head calls through the executor's group.
        assert executor.runner.mirror is (executor.workers if tp > 1 else None)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        got = _generate(engine, {str(i): (p, params) for i, p in enumerate(PROMPTS)})
    finally:
        engine.shutdown()
    assert [got[str(i)] for i in range(len(PROMPTS))] == want


# Run at start-up by every process of the test (rank 0 here, with `patch` = monkeypatch.setattr;
# the other ranks from a sitecustomize, with `patch` = setattr): on the CPU each Worker builds its
# graphs as the CPU has them (a GPU's Worker captures its own), each forward pass logs its path
# and rank, and at most two sequences speculate (so that more decode plainly, pipelined, with
# input tokens filled on the device).
_GRAPHS_AND_PATH_LOG = """
import os
from tritium.layers.parallel_state import get_tp_rank
from tritium.worker import worker
from tritium.worker.model_runner import ModelRunner
_init, _run_path = worker.Worker.__init__, ModelRunner.run_path

def _init_with_graphs(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    if self.device.type == "cpu":
        self.build_graphs(capture=False)

def _logged_run_path(self, call, fill=None):
    with open(os.path.join(LOG_DIR, f"rank{get_tp_rank()}"), "a") as f:
        f.write(f"{call.path.value} {call.batch.num_tokens}\\n")
    if fill is not None:  # input tokens filled on this rank's device (rank 0's only)
        with open(os.path.join(LOG_DIR, f"filled{get_tp_rank()}"), "a") as f:
            f.write(f"{call.path.value} {call.batch.num_tokens}\\n")
    return _run_path(self, call, fill)

patch(worker, "SPEC_GRAPH_MAX_SEQS", 2)
patch(worker.Worker, "__init__", _init_with_graphs)
patch(ModelRunner, "run_path", _logged_run_path)
"""


def _workload() -> dict[str, tuple[list[int], SamplingParams]]:
    """Four prompts in one prefill-only step, decoding four at a time (pipelined), then two (which
    speculate: the prompts repeat themselves), and a request whose prompt logprobs take an
    eager pass."""
    greedy = dict(temperature=0, ignore_eos=True)
    requests = {str(i): (p, SamplingParams(max_tokens=m, **greedy))
                for i, (p, m) in enumerate(zip(PROMPTS, (6, 8, 20, 20)))}
    requests["logprobs"] = ([1, 306, 466, 278, 71], SamplingParams(max_tokens=4, prompt_logprobs=1, **greedy))
    return requests


@pytest.mark.parametrize("tp", [1, 2])
def test_every_rank_runs_the_forward_path_rank_0_chose(llama_dir, tp, tmp_path, monkeypatch):
    _check_ranks_follow_rank_0(llama_dir, tp, "cpu", tmp_path, monkeypatch)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_every_rank_replays_the_cuda_graph_rank_0_chose(llama_dir, tmp_path, monkeypatch):
    _check_ranks_follow_rank_0(llama_dir, 2, "cuda", tmp_path, monkeypatch)


def _check_ranks_follow_rank_0(llama_dir: str, tp: int, device: str, tmp_path, monkeypatch) -> None:
    """The tokens of one eager rank (no graphs); every rank logs rank 0's sequence of paths."""
    kwargs = dict(model=llama_dir, device=device, dtype="float32", max_num_seqs=4,
                  max_num_batched_tokens=64, num_kv_blocks=64, enable_prefix_caching=False,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                      "prompt_lookup_max": 3, "prompt_lookup_min": 2})
    want = _generate(LLMEngine(EngineArgs(enforce_eager=True, **kwargs)), _workload())
    log_dir = tmp_path / "paths"
    log_dir.mkdir()
    (tmp_path / "sitecustomize.py").write_text(f"LOG_DIR = {str(log_dir)!r}\npatch = setattr\n" + _GRAPHS_AND_PATH_LOG)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    exec(_GRAPHS_AND_PATH_LOG, {"LOG_DIR": str(log_dir), "patch": monkeypatch.setattr})
    engine = LLMEngine(EngineArgs(tensor_parallel_size=tp, **kwargs))
    try:
        assert engine.max_speculating_seqs == 2
        assert engine.executor.runner.graphs.use_graphs == (device == "cuda")
        got = _generate(engine, _workload())
        assert engine.stats.spec_decode_num_drafts > 0
    finally:
        engine.shutdown()
    assert got == want
    logs = [(log_dir / f"rank{r}").read_text().splitlines() for r in range(tp)]
    paths = [line.split()[0] for line in logs[0]]
    assert set(paths) == {p.value for p in ForwardPath}
    assert paths[0] == ForwardPath.PREFILL_GRAPH.value  # the four prompts' one step
    # Decodes fed by the step in flight: their inputs are filled on rank 0's device (and reach
    # the other ranks by broadcast).
    assert f"{ForwardPath.DECODE_GRAPH.value} 4" in (log_dir / "filled0").read_text().splitlines()
    for rank in range(1, tp):
        assert logs[rank] == logs[0], f"rank {rank} ran other forward passes than rank 0"
    assert sorted(os.listdir(log_dir)) == ["filled0"] + [f"rank{r}" for r in range(tp)]
