"""Must-show 4: every kind of bad input gets its own clear error while concurrent good streams
finish correctly, and the server stays healthy."""
import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from triton_server import StreamCollector, grpc_inputs, http_request

GOOD = {"max_tokens": 128, "ignore_eos": True, "temperature": 0}


def _int32_stream_flag():
    t = grpcclient.InferInput("stream", [1], "INT32")
    t.set_data_from_numpy(np.array([1], dtype=np.int32))
    return t


BAD_GRPC = [  # (inputs, the exact error message)
    (grpc_inputs("x", sampling="{max_tokens: 4"),
     "sampling_parameters is not valid JSON: Expecting property name enclosed in double quotes: "
     "line 1 column 2 (char 1)."),
    (grpc_inputs("x", sampling={"max_new_tokens": 4}),
     "Unknown sampling parameter 'max_new_tokens'. Valid parameters: allowed_token_ids, bad_words, cache_salt, frequency_penalty, "
     "ignore_eos, include_stop_str_in_output, logit_bias, logprobs, max_tokens, min_p, min_tokens, n, presence_penalty, "
     "prompt_logprobs, "
     "repetition_penalty, seed, skip_special_tokens, spaces_between_special_tokens, stop, stop_token_ids, "
     "structured_outputs, temperature, top_k, top_p, truncate_prompt_tokens."),
    (grpc_inputs("x", sampling={"max_tokens": "many"}),
     "sampling parameter 'max_tokens' must be an integer, got 'many'."),
    (grpc_inputs("x", sampling={"ignore_eos": 3}), "sampling parameter 'ignore_eos' must be a boolean, got 3."),
    (grpc_inputs("x") + [_int32_stream_flag()],
     "inference input 'stream' data-type is 'INT32', but model 'llm' expects 'BOOL'"),
    (grpc_inputs("x", sampling={"temperature": -1}), "temperature must be non-negative, got -1.0."),
    (grpc_inputs("x", sampling={"top_p": 1.5}), "top_p must be in (0, 1], got 1.5."),
    (grpc_inputs("x", sampling={"logprobs": 50}), "logprobs must be in [0, 20], got 50."),
    (grpc_inputs("x", sampling={"n": 65}), "n=65 is larger than max_num_seqs=64."),
    (grpc_inputs(""), "text_input must not be empty."),
    (grpc_inputs("word " * 1100), "tokens, but max_model_len is 1024: "
                                 "prompt plus at least one generated token must fit."),
    (grpc_inputs(b"caf\xc3"), "text_input is not valid UTF-8: unexpected end of data at byte 3."),
    (grpc_inputs(None, sampling={"max_tokens": 4}),
     "text_input is required (or input_ids, for a prompt of token ids)."),
    (grpc_inputs(input_ids=[1, 999999]), "Token id 999999 is out of vocabulary"),
    (grpc_inputs("x", sampling={"logit_bias": {"999999": 5}}),
     "logit_bias: token id 999999 is out of vocabulary (valid ids are 0 to 511)."),
    (grpc_inputs("x", stream=True, exclude_input_in_output=False),
     "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."),
    (grpc_inputs("x", sampling={"priority": "high"}), "priority must be an integer, got 'high'."),
    (grpc_inputs("x", sampling={"guided_decoding": {"regex": "[0-9"}}),
     "structured_outputs: invalid regex: Regex parsing error at position 5: Unclosed '['"),
    (grpc_inputs("x", sampling={"structured_outputs": '{"choice": "yes"}'}),
     "structured_outputs: choice must be a non-empty list of non-empty strings, got 'yes'."),
    # (the priority reaches the engine, whose scheduling_policy is the default)
    (grpc_inputs("x", sampling={"priority": 1}),
     "Got priority 1, but the engine's scheduling_policy is 'fcfs'; priorities need scheduling_policy='priority'."),
]


def test_bad_inputs_get_their_errors_while_good_streams_finish(llm_server, tiny_model):
    good = StreamCollector(llm_server.grpc_url)
    try:
        for i in range(8):
            good.send(f"g{i}", grpc_inputs(f"good request {i}", stream=True, sampling=GOOD,
                                           return_num_output_tokens=True))
        for inputs, message in BAD_GRPC:
            # Errors carry no request id: one stream per bad request ties each error to its request.
            bad = StreamCollector(llm_server.grpc_url)
            try:
                bad.send("bad", inputs)
                error = bad.next_error(timeout=60)
                assert message in error
                assert bad.results["bad"].texts == []
            finally:
                bad.close()
        for i in range(8):
            r = good.wait(f"g{i}")
            assert (r.finals, r.after_final, sum(r.num_output_tokens)) == (1, 0, GOOD["max_tokens"])
        assert good.errors.empty()
    finally:
        good.close()
    assert llm_server.is_ready() and llm_server.is_ready("llm")
    after = StreamCollector(llm_server.grpc_url)
    try:
        after.send("after", grpc_inputs("still serving", stream=True, sampling=GOOD, return_num_output_tokens=True))
        assert sum(after.wait("after").num_output_tokens) == GOOD["max_tokens"]
    finally:
        after.close()


@pytest.mark.parametrize("body, message", [
    ({"text_input": "x", "temperature": -1}, "temperature must be non-negative, got -1.0."),
    ({"text_input": "x", "parameters": {"bogus": 1}}, "Unknown sampling parameter 'bogus'."),
    ({"text_input": "x", "sampling_parameters": "{oops"}, "sampling_parameters is not valid JSON"),
    ({"text_input": ""}, "text_input must not be empty."),
    ({"max_tokens": 3}, "text_input is required"),
])
def test_http_bad_inputs_are_400_with_the_message(llm_server, body, message):
    status, text = http_request(f"{llm_server.http_url}/v2/models/llm/generate", body)
    assert status == 400
    assert message in json.loads(text)["error"]
