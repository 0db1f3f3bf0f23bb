"""Parsing of the vLLM-backend request interface and building of its responses (no server)."""
import json

import numpy as np
import pytest

from tritium.outputs import CompletionOutput, Logprob, RequestOutput
from tritium.serving.triton_request import ParsedRequest, ResponseBuilder, parse_request
from tritium.sampling_params import SamplingParams


def s(text: str | bytes) -> np.ndarray:
    return np.array([text.encode() if isinstance(text, str) else text], dtype=np.object_)


def b(value: bool) -> np.ndarray:
    return np.array([value], dtype=bool)


def test_defaults_match_the_vllm_backend():
    r = parse_request({"text_input": s("Hello")})
    assert r.prompt == "Hello"
    assert r.sampling_params == SamplingParams()  # max_tokens 16, temperature 1.0
    assert (r.stream, r.exclude_input_in_output) == (False, False)
    assert not any(getattr(r, f) for f in ("return_finish_reason", "return_cumulative_logprob",
                                            "return_logprobs", "return_num_input_tokens",
                                            "return_num_output_tokens", "return_num_cached_tokens",
                                            "return_stop_reason"))
    streaming = parse_request({"text_input": s("Hello"), "stream": b(True)})
    assert (streaming.stream, streaming.exclude_input_in_output) == (True, True)


def test_sampling_parameters_as_genai_perf_sends_them():
    r = parse_request({"text_input": s("x"), "stream": b(True), "sampling_parameters":
                       s('{"max_tokens": "256", "ignore_eos": "true", "temperature": 0, "stop": ["a"]}')})
    p = r.sampling_params
    assert (p.max_tokens, p.ignore_eos, p.temperature, p.stop) == (256, True, 0.0, ["a"])


def test_lora_name_as_the_vllm_backend_takes_it():
    r = parse_request({"text_input": s("x"), "sampling_parameters": s('{"lora_name": "sql", "max_tokens": 3}')})
    assert (r.lora_name, r.sampling_params.max_tokens) == ("sql", 3)
    assert parse_request({"text_input": s("x")}, {"lora_name": "doc"}).lora_name == "doc"
    assert parse_request({"text_input": s("x")}).lora_name is None


def test_request_parameters_and_tensor_precedence():
    # The HTTP generate endpoint turns top-level keys into request parameters.
    r = parse_request({"text_input": s("x")},
                      '{"max_tokens": 5, "temperature": 0.5, "stream": "false", '
                      '"exclude_input_in_output": true, "triton_enable_empty_final_response": true, '
                      '"priority": 3}')
    assert (r.sampling_params.max_tokens, r.sampling_params.temperature) == (5, 0.5)
    assert (r.stream, r.exclude_input_in_output) == (False, True)
    assert r.priority == 0  # Triton's own priority parameter is Triton's
    r = parse_request({"text_input": s("x"), "sampling_parameters": s('{"max_tokens": 7}'),
                       "return_finish_reason": b(False)},
                      {"max_tokens": 5, "top_k": 3, "return_finish_reason": True})
    assert (r.sampling_params.max_tokens, r.sampling_params.top_k) == (7, 3)
    assert r.return_finish_reason is False


def test_what_the_openai_frontend_sends():
    # Chat: its defaults (logprobs=false, n=1, ...) and max_completion_tokens mapped to max_tokens.
    chat = {"frequency_penalty": 0, "ignore_eos": False, "logprobs": False, "n": 1, "presence_penalty": 0,
            "temperature": 1, "top_p": 1, "max_tokens": 20}
    p = parse_request({"text_input": s("x"), "sampling_parameters": s(json.dumps(chat))}).sampling_params
    assert (p.logprobs, p.max_tokens, p.n) == (None, 20, 1)
    chat.update(logprobs=True, top_logprobs=3)
    assert parse_request({"text_input": s("x"), "sampling_parameters": s(json.dumps(chat))}
                         ).sampling_params.logprobs == 3
    # Completions: best_of=1 by default, logprobs an integer.
    completion = {"best_of": 1, "n": 1, "logprobs": 2, "max_completion_tokens": 9}
    p = parse_request({"text_input": s("x"), "sampling_parameters": s(json.dumps(completion))}).sampling_params
    assert (p.logprobs, p.max_tokens) == (2, 9)
    # OpenAI's logit_bias: an object keyed by token ids as strings.
    p = parse_request({"text_input": s("x"), "sampling_parameters": s(json.dumps({"logit_bias": {"5": 10, "7": -2.5}}))}
                      ).sampling_params
    assert p.logit_bias == {5: 10.0, 7: -2.5}
    for bad, message in [({"best_of": 3, "n": 1}, "best_of must equal n (sampling more candidates than "
                          "returned is not supported), got best_of=3."),
                         ({"logit_bias": {"five": 10}}, "sampling parameter 'logit_bias' must be an object "
                          "of token ids to numbers, got {'five': 10}."),
                         ({"logit_bias": {"5": "inf"}}, "logit_bias values must be finite numbers, got inf "
                          "for token 5."),
                         ({"allowed_token_ids": []}, "allowed_token_ids must not be empty.")]:
        with pytest.raises(ValueError) as e:
            parse_request({"text_input": s("x"), "sampling_parameters": s(json.dumps(bad))})
        assert str(e.value) == message


def test_input_ids_prompt():
    r = parse_request({"input_ids": np.array([1, 5, 9], dtype=np.int32)})
    assert r.prompt == [1, 5, 9]


@pytest.mark.parametrize("inputs, parameters, message", [
    ({}, None, "text_input is required (or input_ids, for a prompt of token ids)."),
    ({"text_input": s("")}, None, "text_input must not be empty."),
    ({"text_input": s(b"\xff\xfeabc")}, None, "text_input is not valid UTF-8: invalid start byte at byte 0."),
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, None,
     "text_input must hold exactly one element, got 2."),
    ({"text_input": s("x"), "input_ids": np.array([1], np.int32)}, None,
     "give either text_input or input_ids, not both."),
    ({"input_ids": np.array([], np.int32)}, None, "input_ids must not be empty."),
    ({"input_ids": np.array([3, -1], np.int32)}, None, "input_ids must be non-negative, got -1."),
    ({"text_input": s("x"), "sampling_parameters": s("{bad json")}, None,
     "sampling_parameters is not valid JSON: Expecting property name enclosed in double quotes: "
     "line 1 column 2 (char 1)."),
    ({"text_input": s("x"), "sampling_parameters": s("[1, 2]")}, None,
     "sampling_parameters must be a JSON object, got list."),
    ({"text_input": s("x"), "sampling_parameters": s('{"max_tokens": "many"}')}, None,
     "sampling parameter 'max_tokens' must be an integer, got 'many'."),
    ({"text_input": s("x"), "sampling_parameters": s('{"temperature": -1}')}, None,
     "temperature must be non-negative, got -1.0."),
    ({"text_input": s("x"), "sampling_parameters": s('{"top_p": 0}')}, None,
     "top_p must be in (0, 1], got 0.0."),
    ({"text_input": s("x"), "stream": b(True), "exclude_input_in_output": b(False)}, None,
     "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."),
    ({"text_input": s("x"), "stream": np.array([1], dtype=np.int32)}, None,
     "stream must be a BOOL tensor, got int32."),
    ({"text_input": s("x")}, "{not json", "request parameters are not valid JSON: "
     "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)."),
    ({"text_input": s("x")}, {"stream": "yes"}, "request parameter 'stream' must be a boolean, got 'yes'."),
    ({"text_input": s("x"), "sampling_parameters": s('{"lora_name": 3}')}, None,
     "lora_name must be a non-empty string, got 3."),
    ({"text_input": s("x"), "image": s("x")}, None, "unexpected input 'image'. Valid inputs: text_input, "
     "input_ids, sampling_parameters, stream, exclude_input_in_output, return_finish_reason, "
     "return_cumulative_logprob, return_logprobs, return_num_input_tokens, return_num_output_tokens, "
     "return_num_cached_tokens, return_stop_reason."),
])
def test_bad_requests_raise_clear_errors(inputs, parameters, message):
    with pytest.raises(ValueError) as e:
        parse_request(inputs, parameters)
    assert str(e.value) == message


def test_unknown_sampling_key_names_the_key():
    with pytest.raises(ValueError, match=r"^Unknown sampling parameter 'max_new_tokens'\. Valid parameters: "):
        parse_request({"text_input": s("x"), "sampling_parameters": s('{"max_new_tokens": 3}')})


def _out(deltas: list[tuple[str, list[int]]], finish: str | None, prompt_ids=(1, 2, 3), error=None,
         logprobs=False, cum=None) -> RequestOutput:
    outs = [CompletionOutput(i, text, ids, cum,
                             [{t: Logprob(-0.5, 1, "t")} for t in ids] if logprobs else None, finish)
            for i, (text, ids) in enumerate(deltas)]
    return RequestOutput("0", "Hi", list(prompt_ids), outs, finished=finish is not None, error=error)


def _texts(array: np.ndarray) -> list[str]:
    return [v.decode() for v in array]


def test_streaming_sends_each_delta_and_one_final():
    req = parse_request({"text_input": s("Hi"), "stream": b(True), "return_num_output_tokens": b(True),
                         "return_finish_reason": b(True), "return_num_input_tokens": b(True)})
    builder = ResponseBuilder(req)
    r1 = builder.add(_out([(" a", [7])], None))
    r2 = builder.add(_out([(" bc", [8, 9])], "length"))
    assert (r1.final, r2.final) == (False, True)
    assert _texts(r1.outputs["text_output"]) == [" a"] and _texts(r2.outputs["text_output"]) == [" bc"]
    assert r1.outputs["num_output_tokens"].tolist() == [1] and r2.outputs["num_output_tokens"].tolist() == [2]
    assert r1.outputs["num_output_tokens"].dtype == np.uint32
    assert _texts(r1.outputs["finish_reason"]) == ["None"] and _texts(r2.outputs["finish_reason"]) == ["length"]
    assert r2.outputs["num_input_tokens"].tolist() == [3]
    assert set(r1.outputs) == {"text_output", "finish_reason", "num_input_tokens", "num_output_tokens"}


def test_non_streaming_sends_one_final_with_the_prompt_first():
    builder = ResponseBuilder(parse_request({"text_input": s("Hi")}))
    assert builder.add(_out([(" a", [7])], None)) is None
    r = builder.add(_out([(" b", [8])], "stop"))
    assert r.final and _texts(r.outputs["text_output"]) == ["Hi a b"]
    assert set(r.outputs) == {"text_output"}
    excluded = ResponseBuilder(parse_request({"text_input": s("Hi"), "exclude_input_in_output": b(True)}))
    assert _texts(excluded.add(_out([(" a", [7])], "stop")).outputs["text_output"]) == [" a"]
    ids = ResponseBuilder(parse_request({"input_ids": np.array([1, 2], np.int32)}))
    assert _texts(ids.add(_out([(" a", [7])], "stop")).outputs["text_output"]) == [" a"]


def test_num_cached_tokens_only_when_asked_for():
    """The prompt tokens the prefix cache served, in every response of a stream; a request that
    does not ask (every vLLM backend client) gets no such output."""
    def cached(n: int, finish: str | None) -> RequestOutput:
        out = _out([(" a", [7])], finish, prompt_ids=tuple(range(40)))
        out.num_cached_tokens = n
        return out

    req = parse_request({"text_input": s("Hi"), "stream": b(True), "return_num_cached_tokens": b(True)})
    builder = ResponseBuilder(req)
    r1, r2 = builder.add(cached(32, None)), builder.add(cached(32, "length"))
    assert r1.outputs["num_cached_tokens"].tolist() == r2.outputs["num_cached_tokens"].tolist() == [32]
    assert r1.outputs["num_cached_tokens"].dtype == np.uint32
    whole = ResponseBuilder(parse_request({"text_input": s("Hi"), "return_num_cached_tokens": b(True)}))
    assert whole.add(cached(16, None)) is None
    assert whole.add(cached(16, "stop")).outputs["num_cached_tokens"].tolist() == [16]
    plain = ResponseBuilder(parse_request({"text_input": s("Hi"), "stream": b(True)}))
    assert "num_cached_tokens" not in plain.add(cached(32, "stop")).outputs


def test_stop_reason_only_when_asked_for():
    """vLLM's stop_reason per sample, as JSON: the stop string or stop token id that ended it,
    null while running and for EOS or length; a request that does not ask gets no such output."""
    def stopped(reasons: list[int | str | None], finish: list[str | None]) -> RequestOutput:
        outs = [CompletionOutput(i, "a", [7], None, None, f, r) for i, (r, f) in enumerate(zip(reasons, finish))]
        return RequestOutput("0", "Hi", [1, 2], outs, finished=all(f is not None for f in finish))

    req = parse_request({"text_input": s("Hi"), "stream": b(True), "return_stop_reason": b(True),
                         "sampling_parameters": s('{"n": 3}')})
    builder = ResponseBuilder(req)
    running = builder.add(stopped([None, None, None], [None, None, None]))
    assert _texts(running.outputs["stop_reason"]) == ["null", "null", "null"]
    done = builder.add(stopped(["\n\n", 42, None], ["stop", "stop", "length"]))
    assert [json.loads(v) for v in _texts(done.outputs["stop_reason"])] == ["\n\n", 42, None]
    whole = ResponseBuilder(parse_request({"text_input": s("Hi"), "return_stop_reason": b(True)}))
    assert _texts(whole.add(stopped(["END"], ["stop"])).outputs["stop_reason"]) == ['"END"']
    plain = ResponseBuilder(parse_request({"text_input": s("Hi"), "stream": b(True)}))
    assert "stop_reason" not in plain.add(stopped(["END"], ["stop"])).outputs


def test_n_samples_and_logprobs_in_the_vllm_backend_format():
    req = parse_request({"text_input": s("Hi"), "return_logprobs": b(True), "return_cumulative_logprob": b(True),
                         "return_num_output_tokens": b(True),
                         "sampling_parameters": s('{"n": 2, "logprobs": 0}')})
    builder = ResponseBuilder(req)
    builder.add(_out([("a", [4]), ("b", [5])], None, logprobs=True, cum=-0.5))
    r = builder.add(_out([("c", [6]), ("", [])], "length", logprobs=True, cum=-1.0))
    assert _texts(r.outputs["text_output"]) == ["Hiac", "Hib"]
    assert r.outputs["num_output_tokens"].tolist() == [2, 1]
    assert r.outputs["cumulative_logprob"].tolist() == [-1.0, -1.0]
    assert [json.loads(v) for v in r.outputs["logprobs"]] == [
        [{"4": {"logprob": -0.5, "rank": 1, "decoded_token": "t"}},
         {"6": {"logprob": -0.5, "rank": 1, "decoded_token": "t"}}],
        [{"5": {"logprob": -0.5, "rank": 1, "decoded_token": "t"}}]]


def test_impossible_tokens_logprobs_stay_valid_json():
    """A grammar masks tokens to -inf; JSON has no -Infinity, so they go as vLLM sends them."""
    req = parse_request({"text_input": s("Hi"), "stream": b(True), "return_logprobs": b(True)})
    out = _out([("a", [4])], "stop")
    out.outputs[0].logprobs = [{4: Logprob(-0.25, 1, "a"), 5: Logprob(float("-inf"), 2, "b")}]
    text = _texts(ResponseBuilder(req).add(out).outputs["logprobs"])[0]
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"not JSON: {c}")) == [
        {"4": {"logprob": -0.25, "rank": 1, "decoded_token": "a"},
         "5": {"logprob": -9999.0, "rank": 2, "decoded_token": "b"}}]


def test_logprobs_null_when_not_requested_and_nan_cumulative():
    req = parse_request({"text_input": s("Hi"), "stream": b(True), "return_logprobs": b(True),
                         "return_cumulative_logprob": b(True)})
    r = ResponseBuilder(req).add(_out([("a", [4])], "stop"))
    assert _texts(r.outputs["logprobs"]) == ["null"]
    assert np.isnan(r.outputs["cumulative_logprob"][0])


def test_prompt_logprobs_go_once_streamed_and_in_the_final_response_otherwise():
    prompt_logprobs = [None, {2: Logprob(-1.25, 3)}, {3: Logprob(-0.5, 1), 9: Logprob(-2.0, 2)}]
    expected = [None, {"2": {"logprob": -1.25, "rank": 3, "decoded_token": None}},
                {"3": {"logprob": -0.5, "rank": 1, "decoded_token": None},
                 "9": {"logprob": -2.0, "rank": 2, "decoded_token": None}}]
    params = s('{"prompt_logprobs": 1}')
    streamed = ResponseBuilder(parse_request({"text_input": s("Hi"), "stream": b(True),
                                              "sampling_parameters": params}))
    first = _out([("a", [4])], None)
    first.prompt_logprobs = prompt_logprobs
    responses = [streamed.add(first), streamed.add(_out([("b", [5])], None)), streamed.add(_out([("", [])], "length"))]
    assert [json.loads(r.outputs["prompt_logprobs"][0]) if "prompt_logprobs" in r.outputs else None
            for r in responses] == [expected, None, None]
    whole = ResponseBuilder(parse_request({"text_input": s("Hi"), "sampling_parameters": params}))
    assert whole.add(first) is None
    final = whole.add(_out([("b", [5])], "length"))
    assert json.loads(final.outputs["prompt_logprobs"][0]) == expected
    assert "prompt_logprobs" not in ResponseBuilder(parse_request({"text_input": s("Hi")})).add(
        _out([("a", [4])], "length")).outputs


def test_engine_error_is_the_final_response():
    builder = ResponseBuilder(parse_request({"text_input": s("Hi"), "stream": b(True)}))
    builder.add(_out([("a", [4])], None))
    r = builder.add(_out([("", [])], "abort", error="engine shut down"))
    assert (r.final, r.error, r.outputs) == (True, "engine shut down", {})
    with pytest.raises(AssertionError):
        builder.add(_out([("", [])], "abort"))


def test_parsed_request_is_plain_data():
    r = parse_request({"text_input": s("x"), "return_logprobs": b(True)})
    assert r == ParsedRequest(prompt="x", sampling_params=SamplingParams(), return_logprobs=True)


def test_fold_outputs_merges_a_requests_deltas_without_touching_the_engines_objects():
    from tritium.outputs import CompletionOutput, RequestOutput
    from tritium.serving.output_folding import fold_outputs

    def delta(rid, text, ids, finished=False):
        return RequestOutput(rid, None, [1, 2], [CompletionOutput(0, text, ids, -1.0, None,
                                                                   "length" if finished else None)],
                             finished)

    a1, b1, a2, a3 = delta("a", "he", [5]), delta("b", "x", [9]), delta("a", "ll", [6]), delta("a", "o", [7], True)
    folded = fold_outputs([("a", a1), ("b", b1), ("a", a2), ("a", a3)])
    assert [rid for rid, _ in folded] == ["a", "b"]
    a = folded[0][1]
    assert (a.outputs[0].text, a.outputs[0].token_ids, a.finished, a.outputs[0].finish_reason) == \
           ("hello", [5, 6, 7], True, "length")
    assert folded[1][1] is b1  # a lone delta passes through
    assert (a1.outputs[0].text, a1.outputs[0].token_ids, a1.finished) == ("he", [5], False)


def test_fold_outputs_equals_accumulating_the_deltas_in_both_paths():
    """The one-sample fast path and the general one (logprobs, n samples) give what the
    engine's own accumulate gives; an output after a finished one starts a new group."""
    from tritium.engine.request import accumulate
    from tritium.outputs import CompletionOutput, Logprob, RequestOutput
    from tritium.serving.output_folding import fold_outputs

    def delta(ids, index=0, logprobs=None, finished=False, cached=0):
        c = CompletionOutput(index, "".join(chr(97 + t % 26) for t in ids), ids, -0.5 * ids[-1], logprobs,
                             "stop" if finished else None, 7 if finished else None)
        return RequestOutput("r", "p", [1, 2], [c], finished, num_cached_tokens=cached)

    plain = [delta([3], cached=2), delta([4, 5]), delta([6], finished=True)]
    with_logprobs = [delta([3], logprobs=[{3: Logprob(-0.1)}]), delta([4], logprobs=[{4: Logprob(-0.2)}])]
    two_samples = [delta([3], index=0), delta([8], index=1), delta([4], index=0, finished=True)]
    for deltas in (plain, with_logprobs, two_samples):
        expected = None
        for d in deltas:
            expected = accumulate(expected, d)
        [(rid, folded)] = fold_outputs([("r", d) for d in deltas])
        assert rid == "r" and folded == expected
    after_final = fold_outputs([("r", plain[2]), ("r", plain[0])])
    assert [o for _, o in after_final] == [plain[2], plain[0]]


def test_priority_arrives_in_sampling_parameters():
    assert parse_request({"text_input": s("x"), "sampling_parameters": s('{"priority": -2}')}).priority == -2
    assert parse_request({"text_input": s("x"), "sampling_parameters": s('{"priority": "3"}')}).priority == 3
    assert parse_request({"text_input": s("x")}).priority == 0
    for bad in ('"high"', "1.5", "true"):
        with pytest.raises(ValueError) as info:
            parse_request({"text_input": s("x"), "sampling_parameters": s('{"priority": %s}' % bad)})
        assert str(info.value).startswith("priority must be an integer, got ")


def test_structured_outputs_arrive_under_either_name():
    """As a sampling_parameters object, or as a request parameter holding JSON (what the HTTP
    generate endpoint makes of a top-level string)."""
    want = {"choice": ["a", "b"], "disable_any_whitespace": False}
    r = parse_request({"text_input": s("x"), "sampling_parameters": s('{"guided_decoding": {"choice": ["a", "b"]}}')})
    assert r.sampling_params.structured_outputs == want
    r = parse_request({"text_input": s("x")}, {"structured_outputs": '{"choice": ["a", "b"]}'})
    assert r.sampling_params.structured_outputs == want
    with pytest.raises(ValueError) as info:
        parse_request({"text_input": s("x")}, {"guided_decoding": "[1]"})
    assert str(info.value) == "sampling parameter 'guided_decoding' must be a JSON object, got [1]."


def test_a_model_info_request_is_answered_with_the_models_description():
    from tritium.serving.triton_request import model_info_asked, model_info_outputs

    assert [model_info_asked(p) for p in ({"model_info": True}, '{"model_info": "true"}', {"model_info": False},
                                          '{"return_error_details": true}', None, "not json")] == [
        True, True, False, False, False, False]
    from types import SimpleNamespace as NS
    outputs = model_info_outputs(NS(model="/models/llama", enable_lora=True, lora_modules={"sql": "/loras/sql"}),
                                 NS(max_model_len=4096))
    assert list(outputs) == ["text_output"] and outputs["text_output"].dtype == np.object_
    assert json.loads(outputs["text_output"][0]) == {"model": "/models/llama", "max_model_len": 4096,
                                                     "lora_modules": {"sql": "/loras/sql"}}
    without_lora = NS(model="/m", enable_lora=False, lora_modules={"sql": "/loras/sql"})
    assert json.loads(model_info_outputs(without_lora, NS(max_model_len=8))["text_output"][0])["lora_modules"] == {}


def test_kv_transfer_params_ride_in_sampling_parameters_and_come_back_in_the_final_response():
    """Disaggregated prefill through the request interface: the proxy's kv_transfer_params go
    to the engine as SamplingParams.extra_args; a prefill instance's come back as a JSON tensor
    in the final response, also when the sender folded deltas."""
    from tritium.serving.output_folding import fold_outputs
    produced = {"do_remote_prefill": True, "remote_block_ids": [4, 9], "remote_num_tokens": 5}
    r = parse_request({"text_input": s("x"), "sampling_parameters": s(json.dumps(
        {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}))})
    assert r.sampling_params.extra_args == {"kv_transfer_params": {"do_remote_decode": True}}
    with pytest.raises(ValueError, match=r"^kv_transfer_params must be an object, got list\.$"):
        parse_request({"text_input": s("x"), "sampling_parameters": s('{"kv_transfer_params": [1]}')})
    first = RequestOutput("r", "x", [1, 2, 3, 4, 5], [CompletionOutput(0, "a", [7], None, None)], False)
    last = RequestOutput("r", "x", [1, 2, 3, 4, 5], [CompletionOutput(0, "b", [8], None, None, "length")], True,
                         kv_transfer_params=produced)
    [(_, folded)] = fold_outputs([("r", first), ("r", last)])
    assert folded.kv_transfer_params == produced
    builder = ResponseBuilder(parse_request({"text_input": s("x")}))
    assert builder.add(first) is None
    response = builder.add(last)
    assert response.final and json.loads(response.outputs["kv_transfer_params"][0]) == produced
    plain = ResponseBuilder(parse_request({"text_input": s("x")}))
    plain.add(first)
    assert "kv_transfer_params" not in plain.add(RequestOutput("r", "x", [1], [CompletionOutput(
        0, "b", [8], None, None, "length")], True)).outputs
