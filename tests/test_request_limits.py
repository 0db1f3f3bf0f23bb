"""The Triton door's bounds on every size a request sets (backend/serving/request_limits.py),
through parse_request: each refused naming its parameter and the limit, before any per-sample
state, list or token is built from it."""
import json

import numpy as np
import pytest

from tritium.errors import ErrorKind, ParameterError, request_error
from tritium.serving.triton_request import parse_request


def s(text: str) -> np.ndarray:
    return np.array([text.encode()], dtype=np.object_)


def parse(sampling: dict | str | None = None, parameters: dict | None = None, **inputs: np.ndarray):
    if sampling is not None:
        inputs["sampling_parameters"] = s(sampling if isinstance(sampling, str) else json.dumps(sampling))
    return parse_request({"text_input": s("x"), **inputs}, parameters)


# (sampling parameters, the parameter named, the exact message)
OVERSIZED = [
    ({"n": 2_000_000}, "n", "n must be at most 128, got 2000000."),
    ({"n": "2000000"}, "n", "n must be at most 128, got 2000000."),  # as genai-perf sends values
    ({"n": 1e9}, "n", "n must be at most 128, got 1000000000."),
    ({"n": 129, "best_of": 129}, "n", "n must be at most 128, got 129."),
    ({"best_of": 10**9}, "best_of", "best_of must be at most 128, got 1000000000."),
    ({"logprobs": 10**9}, "logprobs", "logprobs must be in [0, 20], got 1000000000."),  # SamplingParams'
    ({"prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs must be in [0, 20], got 21."),
    ({"stop": ["a"] * 100_000}, "stop", "stop may hold at most 64 strings, got 100000."),
    ({"stop": json.dumps(["a"] * 65)}, "stop", "stop may hold at most 64 strings, got 65."),
    ({"stop": "x" * 1025}, "stop", "stop may have at most 1024 characters, got 1025."),
    ({"stop": ["a", "x" * 1025]}, "stop", "stop[1] may have at most 1024 characters, got 1025."),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias",
     "logit_bias may hold at most 1024 entries, got 1025."),
    ({"logit_bias": json.dumps({str(i): 1 for i in range(1025)})}, "logit_bias",
     "logit_bias may hold at most 1024 entries, got 1025."),
    ({"stop_token_ids": [1] * (2**18 + 1)}, "stop_token_ids",
     "stop_token_ids may hold at most 262144 token ids, got 262145."),
    ({"allowed_token_ids": [1] * (2**18 + 1)}, "allowed_token_ids",
     "allowed_token_ids may hold at most 262144 token ids, got 262145."),
    ({"bad_words": ["w"] * 1025}, "bad_words", "bad_words may hold at most 1024 strings, got 1025."),
    ({"bad_words": ["x" * 1025]}, "bad_words", "bad_words[0] may have at most 1024 characters, got 1025."),
    ({"guided_decoding": {"choice": ["c"] * 1025}}, "guided_decoding",
     "guided_decoding.choice may hold at most 1024 strings, got 1025."),
    ({"structured_outputs": json.dumps({"choice": ["c", "x" * 1025]})}, "structured_outputs",
     "structured_outputs.choice[1] may have at most 1024 characters, got 1025."),
]


@pytest.mark.parametrize("sampling, parameter, message", OVERSIZED,
                         ids=[f"{i}-{case[1]}" for i, case in enumerate(OVERSIZED)])
def test_each_size_is_refused_naming_the_parameter_and_its_limit(sampling, parameter, message):
    with pytest.raises(ParameterError) as e:
        parse(sampling)
    error = request_error(e.value)
    assert (error.message, error.parameter, error.kind) == (message, parameter, ErrorKind.INVALID_ARGUMENT)


def test_sizes_given_as_request_parameters_are_bounded_too():
    # The HTTP generate endpoint turns top-level keys into request parameters.
    with pytest.raises(ParameterError, match=r"^n must be at most 128, got 2000000\.$"):
        parse(parameters={"n": 2_000_000})


def test_the_prompt_and_the_sampling_parameters_json_are_bounded_before_decoding_or_tokenizing():
    with pytest.raises(ParameterError) as e:
        parse(text_input=s("x" * (4 * 2**20 + 1)))
    assert (str(e.value), e.value.parameter) == (
        "text_input may have at most 4194304 characters, got 4194305.", "text_input")
    with pytest.raises(ParameterError) as e:
        parse_request({"input_ids": np.zeros(2**20 + 1, dtype=np.int32)})
    assert (str(e.value), e.value.parameter) == (
        "input_ids may have at most 1048576 token ids, got 1048577.", "input_ids")
    with pytest.raises(ParameterError) as e:
        parse(sampling=" " * (16 * 2**20 + 1))
    assert (str(e.value), e.value.parameter) == (
        "sampling_parameters may have at most 16777216 characters, got 16777217.", "sampling_parameters")


def test_sizes_at_their_limits_are_accepted():
    p = parse({"n": 128, "best_of": "128", "stop": ["s" * 1024] * 64, "logit_bias": {str(i): 1 for i in range(1024)},
               "bad_words": ["w"] * 1024, "allowed_token_ids": [1] * 2**18, "logprobs": 20}).sampling_params
    assert (p.n, len(p.stop), len(p.logit_bias), len(p.bad_words), len(p.allowed_token_ids), p.logprobs) == (
        128, 64, 1024, 1024, 2**18, 20)
    assert len(parse_request({"input_ids": np.ones(2**20, dtype=np.int32)}).prompt) == 2**20
    assert len(parse(text_input=s("x" * 4 * 2**20)).prompt) == 4 * 2**20
