"""distributed_executor_backend (vLLM's engine argument): "uni", "mp", or an Executor subclass
by its qualified name, which then runs every step (benchmarks/response_path/ serves with one);
a bad value is refused with a message that says what is accepted."""
from __future__ import annotations

import pytest

from tritium import EngineArgs, LLMEngine, SamplingParams
from tritium.worker.executor import Executor, TensorParallelExecutor, UniProcExecutor

SYNTHETIC = "benchmarks.response_path.synthetic_executor.SyntheticExecutor"


def _config(llama_dir: str, **kwargs):
    args = EngineArgs(model=llama_dir, max_model_len=64, **kwargs)
    return args.create_engine_config(args.create_model_config(lambda hf: __import__(
        "tritium.models", fromlist=["model_limits"]).model_limits(hf)))


def test_the_default_and_the_named_backends_resolve(llama_dir):
    assert _config(llama_dir).parallel_config.distributed_executor_backend == "uni"
    assert _config(llama_dir, tensor_parallel_size=2).parallel_config.distributed_executor_backend == "mp"
    assert Executor.get_class(_config(llama_dir, distributed_executor_backend="uni")) is UniProcExecutor
    assert Executor.get_class(_config(llama_dir, tensor_parallel_size=2,
                                      distributed_executor_backend="mp")) is TensorParallelExecutor
    from benchmarks.response_path.synthetic_executor import SyntheticExecutor
    assert Executor.get_class(_config(llama_dir, distributed_executor_backend=SYNTHETIC)) is SyntheticExecutor


@pytest.mark.parametrize("value, message", [
    ("ray", "distributed_executor_backend='ray' is not supported by Tritium: use 'uni' (one device), 'mp' "
            "(tensor-parallel ranks in processes) or an Executor class's qualified name."),
    ("Executor", "distributed_executor_backend must be 'uni', 'mp' or the qualified name of an Executor class "
                 "('package.module.Class'), got 'Executor'."),
    ("mp", "distributed_executor_backend='mp' starts tensor-parallel ranks; with tensor_parallel_size=1 use 'uni'."),
])
def test_bad_values_are_refused_when_the_arguments_are_made(llama_dir, value, message):
    with pytest.raises(ValueError) as info:
        EngineArgs(model=llama_dir, distributed_executor_backend=value)
    assert str(info.value) == message
    with pytest.raises(ValueError) as info:
        EngineArgs(model=llama_dir, tensor_parallel_size=2, distributed_executor_backend="uni")
    assert str(info.value) == "distributed_executor_backend='uni' runs one device; tensor_parallel_size=2 needs 'mp'."


def test_a_class_that_cannot_be_used_is_refused_when_the_engine_is_built(llama_dir):
    with pytest.raises(ValueError) as info:
        Executor.get_class(_config(llama_dir, distributed_executor_backend="tritium.no_such_module.X"))
    assert str(info.value) == ("distributed_executor_backend='tritium.no_such_module.X': cannot import it: "
                               "No module named 'tritium.no_such_module'")
    with pytest.raises(ValueError) as info:
        Executor.get_class(_config(llama_dir, distributed_executor_backend="tritium.config.EngineArgs"))
    assert str(info.value) == ("distributed_executor_backend='tritium.config.EngineArgs' is not a subclass of "
                               "tritium.worker.executor.Executor.")


def test_the_named_class_runs_the_steps(llama_dir):
    """The synthetic executor's tokens, a fixed function of sequence and count, come back
    through the real scheduler and output processing."""
    from tritium.engine.request import accumulate
    from benchmarks.response_path.synthetic_executor import SyntheticExecutor, synthetic_token
    engine = LLMEngine(EngineArgs(model=llama_dir, max_model_len=64, distributed_executor_backend=SYNTHETIC))
    assert isinstance(engine.executor, SyntheticExecutor)
    seq_ids, totals = {}, {}
    for rid, prompt in (("a", [1, 2, 3]), ("b", [4, 5])):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=5, ignore_eos=True))
        seq_ids[rid] = engine.requests[rid].seqs[0].seq_id
    while engine.has_unfinished_requests():
        for out in engine.step():
            totals[out.request_id] = accumulate(totals.get(out.request_id), out)
    for rid, seq_id in seq_ids.items():
        assert totals[rid].outputs[0].token_ids == [synthetic_token(seq_id, k, engine.vocab_size) for k in range(5)]
        assert totals[rid].outputs[0].text != ""  # real text from the model's tokenizer
    engine.shutdown()
