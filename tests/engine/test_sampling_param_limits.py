"""Values that would overflow the sampler are refused: NaN and infinities in every float
parameter, logit biases beyond what float32 logits take, and prompt + max_tokens beyond
max_model_len (vLLM's check and message)."""
from __future__ import annotations

import json
import math

import pytest

from tritium import EngineArgs, LLMEngine, SamplingParams
from tritium.sampling_params import _FLOAT_FIELDS

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("name", _FLOAT_FIELDS)
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_every_float_parameter_refuses_nan_and_inf(name, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{name: value})
    assert str(info.value) == f"{name} must be a finite number, got {value}."
    # As servers receive them: JSON's NaN / Infinity, or strings.
    for raw in (json.loads(json.dumps({name: value}))[name], str(value)):
        with pytest.raises(ValueError, match=f"^{name} must be a finite number"):
            SamplingParams.from_dict({name: raw})


def test_float_fields_are_all_the_float_parameters():
    from tritium.sampling_params import _PUBLIC_FIELDS
    assert set(_FLOAT_FIELDS) == {k for k, kind in _PUBLIC_FIELDS.items() if kind == "float"}


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": 1e300}, "temperature must be at most 3.403e+38 (the sampler's float32), got 1e+300."),
    ({"repetition_penalty": 1e-30}, "repetition_penalty must be at least 0.0001 (smaller values overflow the "
                                    "sampler's float32 logits), got 1e-30."),
    ({"repetition_penalty": 3.0}, "repetition_penalty must be in (0, 2], got 3.0."),
    ({"presence_penalty": 1e308}, "presence_penalty must be in [-2, 2], got 1e+308."),
    ({"frequency_penalty": -1e308}, "frequency_penalty must be in [-2, 2], got -1e+308."),
    ({"top_p": 1e-320}, None),  # tiny but in range: accepted
    ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5."),
    ({"logit_bias": {42: 1e308}}, "logit_bias values must be in [-1e+10, 1e+10] (the sampler adds them to "
                                  "float32 logits), got 1e+308 for token 42."),
    ({"logit_bias": {42: -1e11}}, "logit_bias values must be in [-1e+10, 1e+10] (the sampler adds them to "
                                  "float32 logits), got -100000000000.0 for token 42."),
    ({"logit_bias": {42: NAN}}, "logit_bias values must be finite numbers, got nan for token 42."),
    ({"logit_bias": {42: -INF}}, "logit_bias values must be finite numbers, got -inf for token 42."),
])
def test_out_of_range_floats(kwargs, message):
    if message is None:
        SamplingParams(**kwargs)
        return
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message


def test_logit_bias_from_json_as_the_issue_sent_it():
    with pytest.raises(ValueError, match=r"got 1e\+308 for token 42\.$"):
        SamplingParams.from_dict(json.loads('{"logit_bias": {"42": 1e308}}'))
    assert SamplingParams.from_dict({"logit_bias": {"42": 1e10}}).logit_bias == {42: 1e10}


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine(EngineArgs(model=llama_dir, max_model_len=64))


def test_prompt_plus_max_tokens_beyond_max_model_len_is_refused(engine):
    with pytest.raises(ValueError) as info:
        engine.add_request("x", list(range(10)), SamplingParams(max_tokens=55))
    assert str(info.value) == ("This model's maximum context length is 64 tokens. However, you requested "
                               "65 tokens (10 in the prompt, 55 in the completion). Please reduce the "
                               "length of the prompt or completion.")
    # 1e9 as JSON sends it: an integer-valued float, refused rather than capped.
    with pytest.raises(ValueError, match=r"you requested 1000000010 tokens \(10 in the prompt, 1000000000 in"):
        engine.add_request("x", list(range(10)), SamplingParams.from_dict({"max_tokens": 1e9}))
    engine.add_request("fits", list(range(10)), SamplingParams(max_tokens=54, ignore_eos=True, temperature=0))
    engine.add_request("unset", list(range(10)), SamplingParams(max_tokens=None, ignore_eos=True, temperature=0))
    lengths = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            lengths[out.request_id] = lengths.get(out.request_id, 0) + len(out.outputs[0].token_ids)
    assert lengths == {"fits": 54, "unset": 54}  # max_tokens=None: up to max_model_len


def test_extreme_but_valid_values_sample_real_tokens(engine):
    """At the bounds, the sampler's logits stay finite: a +1e10 bias on one token makes it the
    sample at any temperature, with the strongest repetition penalty allowed."""
    params = SamplingParams(temperature=1e-5, logit_bias={7: 1e10}, repetition_penalty=1e-4, max_tokens=4,
                            ignore_eos=True, seed=0, logprobs=0)
    engine.add_request("b", [1, 2, 3], params)
    tokens, logprobs = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
            logprobs += [e[t].logprob for e, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
    assert tokens == [7, 7, 7, 7]
    assert all(math.isfinite(lp) for lp in logprobs)
