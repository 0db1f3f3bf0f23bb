"""Auto-completing and checking a model configuration (backend/serving/model_config_check.py), with
the python backend's own ModelConfig class (triton_python_backend_utils.py of the tritonserver
wheel, plain Python) and configurations in the JSON form Triton hands it."""
import importlib.util
import json
import os
import re

import pytest
import pytriton

from tritium.serving.model_config_check import INPUTS, OUTPUTS, auto_complete, check_model_config
from tritium.serving.triton_request import INPUT_NAMES


def _pb_utils():
    path = os.path.join(os.path.dirname(pytriton.__file__), "tritonserver", "backends", "python",
                        "triton_python_backend_utils.py")
    spec = importlib.util.spec_from_file_location("triton_python_backend_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pb_utils = _pb_utils()


def _tensor(name, data_type, dims, optional=False):
    # Triton's JSON form prints every scalar field, `optional` included.
    return {"name": name, "data_type": data_type, "dims": dims, "optional": optional}


def _config(**fields):
    """A configuration as Triton hands it to auto-complete: the vLLM backend's current sample
    (backend and instance_group only) plus `fields`."""
    config = {"name": "vllm_model", "backend": "tritium", "max_batch_size": 0, "input": [], "output": [],
              "instance_group": [{"count": 1, "kind": "KIND_MODEL"}], "parameters": {}}
    config.update(fields)
    return config


def _complete(config):
    return auto_complete(pb_utils.ModelConfig(json.dumps(config))).as_dict()


def test_the_current_vllm_sample_is_completed():
    done = _complete(_config())
    assert sorted(t["name"] for t in done["input"]) == sorted(INPUT_NAMES)
    assert all(t["optional"] for t in done["input"])
    assert {t["name"]: (t["data_type"], t["dims"]) for t in done["input"]} == {
        "text_input": ("TYPE_STRING", [1]), "input_ids": ("TYPE_INT32", [-1]),
        "sampling_parameters": ("TYPE_STRING", [1]), "stream": ("TYPE_BOOL", [1]),
        "exclude_input_in_output": ("TYPE_BOOL", [1]), "return_finish_reason": ("TYPE_BOOL", [1]),
        "return_cumulative_logprob": ("TYPE_BOOL", [1]), "return_logprobs": ("TYPE_BOOL", [1]),
        "return_num_input_tokens": ("TYPE_BOOL", [1]), "return_num_output_tokens": ("TYPE_BOOL", [1]),
        "return_num_cached_tokens": ("TYPE_BOOL", [1]), "return_stop_reason": ("TYPE_BOOL", [1])}
    assert {t["name"]: (t["data_type"], t["dims"]) for t in done["output"]} == {
        "text_output": ("TYPE_STRING", [-1]), "finish_reason": ("TYPE_STRING", [-1]),
        "cumulative_logprob": ("TYPE_FP32", [-1]), "logprobs": ("TYPE_STRING", [-1]),
        "prompt_logprobs": ("TYPE_STRING", [-1]), "num_input_tokens": ("TYPE_UINT32", [1]),
        "num_output_tokens": ("TYPE_UINT32", [-1]), "num_cached_tokens": ("TYPE_UINT32", [1]),
        "stop_reason": ("TYPE_STRING", [-1]), "kv_transfer_params": ("TYPE_STRING", [1])}
    assert done["model_transaction_policy"] == {"decoupled": True} and done["max_batch_size"] == 0
    assert check_model_config(done) == []  # what initialize() then gets passes its check


def test_the_older_spelled_out_sample_keeps_its_declarations():
    """The vLLM backend's older sample: text_input and stream required, three inputs, one output."""
    inputs = [_tensor("text_input", "TYPE_STRING", [1]), _tensor("stream", "TYPE_BOOL", [1]),
              _tensor("sampling_parameters", "TYPE_STRING", [1], optional=True)]
    done = _complete(_config(input=[dict(t) for t in inputs],
                             output=[{"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]}],
                             model_transaction_policy={"decoupled": True}))
    assert done["input"][:3] == inputs  # left as declared (required stays required)
    assert [t["name"] for t in done["input"][3:]] == [n for n in INPUT_NAMES if n not in
                                                       ("text_input", "stream", "sampling_parameters")]
    assert len(done["output"]) == len(OUTPUTS)


def _declared(section: str) -> list[dict]:
    """The tensors of one section of model_repository/llm/config.pbtxt, in Triton's JSON form."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_repository",
                        "llm", "config.pbtxt")
    text = open(path, encoding="utf-8").read()
    body = re.search(rf"^{section} \[(.*?)^\]", text, re.M | re.S).group(1)
    tensors = []
    for m in re.finditer(r'\{ name: "(\w+)" data_type: (\w+) dims: \[ ([-\d, ]+) \]( optional: true)? \}', body):
        tensors.append({"name": m.group(1), "data_type": m.group(2),
                        "dims": [int(d) for d in m.group(3).split(",")], "optional": bool(m.group(4))})
    return tensors


def test_the_projects_own_configuration_declares_what_auto_complete_would():
    inputs, outputs = _declared("input"), _declared("output")
    assert [t["name"] for t in inputs] == [s.name for s in INPUTS]
    assert [t["name"] for t in outputs] == [s.name for s in OUTPUTS]
    for t in outputs:
        del t["optional"]
    config = _config(input=inputs, output=outputs, model_transaction_policy={"decoupled": True})
    assert _complete(json.loads(json.dumps(config))) == config  # nothing to add, nothing refused
    assert _complete(_config())["input"] == inputs and _complete(_config())["output"] == outputs


@pytest.mark.parametrize("fields, message", [
    ({"model_transaction_policy": {"decoupled": False}},
     "model_transaction_policy: the engine streams its responses, so the model must be decoupled: set "
     "model_transaction_policy { decoupled: true }, or leave it out and let Triton auto-complete it "
     "(without --disable-auto-complete-config)."),
    ({"max_batch_size": 8},
     "max_batch_size: the engine batches requests itself (continuous batching), so Triton must not: "
     "set max_batch_size: 0 or leave it out, got 8."),
    ({"input": [_tensor("stream", "TYPE_STRING", [1])]},
     "input 'stream': data_type must be TYPE_BOOL, got TYPE_STRING."),
    ({"input": [_tensor("text_input", "TYPE_STRING", [2])]},
     "input 'text_input': dims must hold one element ([ 1 ]), got [2]."),
    ({"input": [_tensor("input_ids", "TYPE_FP32", [-1], optional=True)]},
     "input 'input_ids': data_type must be TYPE_INT16 or TYPE_INT32 or TYPE_INT64 or TYPE_INT8 or "
     "TYPE_UINT16 or TYPE_UINT32 or TYPE_UINT64 or TYPE_UINT8, got TYPE_FP32."),
    ({"input": [_tensor("image", "TYPE_STRING", [-1])]},
     "input 'image': Tritium does not read it, and the configuration makes every request carry it; "
     "valid inputs: text_input, input_ids, stream, sampling_parameters, exclude_input_in_output, "
     "return_finish_reason, return_cumulative_logprob, return_logprobs, return_num_input_tokens, "
     "return_num_output_tokens, return_num_cached_tokens, return_stop_reason."),
    ({"output": [{"name": "num_output_tokens", "data_type": "TYPE_INT32", "dims": [-1]}]},
     "output 'num_output_tokens': data_type must be TYPE_UINT32, got TYPE_INT32."),
])
def test_a_contradicting_configuration_is_refused_naming_the_key(fields, message):
    with pytest.raises(ValueError) as e:
        _complete(_config(**fields))
    assert str(e.value) == message


def test_what_the_engine_can_read_is_accepted():
    done = _complete(_config(input=[_tensor("input_ids", "TYPE_INT64", [1, -1], optional=True),
                                    _tensor("image", "TYPE_STRING", [-1], optional=True)]))
    assert done["input"][0]["data_type"] == "TYPE_INT64"
    assert check_model_config(done) == [
        "tritium: input 'image' is declared, but Tritium does not read it: a request that carries it is refused."]


def test_loading_without_auto_complete_needs_the_decoupled_policy():
    """With --disable-auto-complete-config, initialize() gets the configuration as written."""
    with pytest.raises(ValueError, match=r"^model_transaction_policy: the engine streams"):
        check_model_config(_config())
    with pytest.raises(ValueError, match=r"^max_batch_size: "):
        check_model_config(_config(max_batch_size=4, model_transaction_policy={"decoupled": True}))
