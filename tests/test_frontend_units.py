"""The frontend's pure parts, without a server: OpenAI fields -> sampling parameters, logprob
entries -> the sampled token, the model's error kinds -> HTTP statuses."""
import pytest

from tritium.errors import ERROR_DETAILS as BACKEND_ERROR_DETAILS
from tritium.errors import ErrorKind, RequestError
from tritium.frontend.errors import ERROR_DETAILS, STATUSES, OpenAIError, from_triton
from tritium.frontend.logprobs import CompletionLogprobs, sampled_key
from tritium.frontend.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from tritium.frontend.sampling import chat_sampling, completion_sampling

MSG = [{"role": "user", "content": "Hi"}]


def chat(**fields):
    return chat_sampling(parse_body(ChatCompletionRequest, {"model": "m", "messages": MSG, **fields}))


def test_chat_fields_become_vllm_sampling_parameters():
    assert chat() == {"n": 1, "max_tokens": None}
    assert chat(max_completion_tokens=5, logprobs=True, top_logprobs=3, top_k=4, seed=1, stop="x") == \
        {"n": 1, "max_tokens": 5, "logprobs": 3, "top_k": 4, "seed": 1, "stop": "x"}
    schema = {"type": "object"}
    assert chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
                structured_outputs={"disable_any_whitespace": True})["structured_outputs"] == \
        {"json": schema, "disable_any_whitespace": True}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    assert chat(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}})[
        "structured_outputs"] == {"json": schema}
    assert "structured_outputs" not in chat(tools=tools, tool_choice="none")
    assert "structured_outputs" not in chat(tools=tools)  # auto, OpenAI's default with tools
    assert chat(tools=tools, tool_choice="required")["structured_outputs"]["json"]["items"]["anyOf"][0][
        "properties"] == {"name": {"type": "string", "enum": ["f"]}, "parameters": schema}
    with pytest.raises(OpenAIError, match="tool_choice 'required' needs tools"):
        chat(tool_choice="required")
    with pytest.raises(OpenAIError, match="give max_completion_tokens or max_tokens"):
        chat(max_tokens=3, max_completion_tokens=4)


def test_completion_fields():
    req = parse_body(CompletionRequest, {"model": "m", "prompt": [1, 2], "logprobs": 2, "echo": True,
                                         "guided_choice": ["a", "b"], "best_of": 1})
    assert completion_sampling(req) == {"n": 1, "logprobs": 2, "prompt_logprobs": 2,
                                        "structured_outputs": {"choice": ["a", "b"]}}
    with pytest.raises(OpenAIError, match="best_of must equal n"):
        completion_sampling(parse_body(CompletionRequest, {"model": "m", "prompt": "p", "best_of": 2}))


def entry(*tokens):
    return {str(t): {"logprob": lp, "rank": r, "decoded_token": s} for t, lp, r, s in tokens}


def test_the_sampled_token_of_a_logprob_entry():
    # k=1 and the sampled token (rank 3) outside the top: the engine appends it last.
    assert sampled_key(entry((7, -0.1, 1, "a"), (9, -2.0, 3, "b")), 1, "b") == "9"
    # Among the top 2: the one whose text comes next in the output.
    assert sampled_key(entry((7, -0.1, 1, "a"), (9, -0.5, 2, "b")), 2, "bc") == "9"
    assert sampled_key(entry((7, -0.1, 1, "a"), (9, -0.5, 2, "b")), 2, "ab") == "7"
    lp = CompletionLogprobs()
    lp.add_output([entry((7, -0.1, 1, "a")), entry((9, -0.5, 1, "bc"))], 1, "abc")
    assert lp.as_dict() == {"tokens": ["a", "bc"], "token_logprobs": [-0.1, -0.5],
                            "top_logprobs": [{"a": -0.1}, {"bc": -0.5}], "text_offset": [0, 1]}
    assert lp.as_dict(1)["tokens"] == ["bc"]


def _model_error(message: str, kind: ErrorKind, parameter: str | None = None) -> str:
    """An error as a Tritium model sends it to a client that asks (ERROR_DETAILS)."""
    return RequestError(message, kind, parameter).to_json()


@pytest.mark.parametrize("message, kind, parameter, status, param", [
    ("top_p must be in (0, 1], got 1.5.", ErrorKind.INVALID_ARGUMENT, "top_p", 400, "top_p"),
    ("Token id 99999 is out of vocabulary (valid ids are 0 to 511).", ErrorKind.INVALID_ARGUMENT, None, 400, None),
    ("The model is being unloaded.", ErrorKind.UNAVAILABLE, None, 503, None),
    ("The engine process exited unexpectedly; the request did not finish.", ErrorKind.UNAVAILABLE, None, 503, None),
    ("Request timed out: its deadline passed while it was running (0.3 s after arrival).", ErrorKind.TIMEOUT,
     None, 504, None),
    ("Request was cancelled", ErrorKind.CANCELLED, None, 499, None),
    ("internal error: boom", ErrorKind.INTERNAL, None, 500, None),
    # The kind decides, not the words: messages that start as the old prefix lists' did.
    ("The engine is shutting down, says the stop parameter", ErrorKind.INVALID_ARGUMENT, "stop", 400, "stop"),
    ("Request timed out (a model's own words)", ErrorKind.INTERNAL, None, 500, None),
    ("top_p is fine; the queue is not", ErrorKind.UNAVAILABLE, "top_p", 503, None),
])
def test_model_errors_map_to_statuses_by_kind(message, kind, parameter, status, param):
    e = from_triton(_model_error(message, kind, parameter))
    assert (e.status, e.param, e.message) == (status, param, message)


def test_the_frontend_speaks_the_models_error_contract():
    # The frontend does not import the engine's package: its copy of the contract must match.
    assert set(STATUSES) == {kind.value for kind in ErrorKind}
    assert ERROR_DETAILS == BACKEND_ERROR_DETAILS


@pytest.mark.parametrize("message", [
    "Request for unknown model: 'x' is not found", "The engine is shutting down.", "top_p must be in (0, 1]",
    "[]", '{"kind": "bogus", "message": "m"}', '{"kind": "internal"}', '{"kind": "internal", "message": 1}'])
def test_errors_that_are_not_the_models_json_are_left_to_the_gateway(message):
    assert from_triton(message) is None


def _response(outputs):
    """A ModelInferResponse as Triton streams it: each output's elements in raw_output_contents."""
    import struct

    from tritonclient.grpc import service_pb2

    r = service_pb2.ModelInferResponse()
    for name, datatype, values in outputs:
        r.outputs.add(name=name, datatype=datatype, shape=[len(values)])
        if datatype == "BYTES":
            r.raw_output_contents.append(b"".join(struct.pack("<I", len(v)) + v for v in values))
        else:
            r.raw_output_contents.append(struct.pack(f"<{len(values)}I", *values))
    return r


def test_parse_chunk_reads_raw_output_contents():
    from tritium.frontend.triton_gateway import parse_chunk

    c = parse_chunk(_response([("text_output", "BYTES", ["é x".encode(), b""]),
                               ("finish_reason", "BYTES", [b"None", b"length"]),
                               ("num_input_tokens", "UINT32", [7]),
                               ("num_output_tokens", "UINT32", [2, 1])]))
    assert (c.texts, c.finish_reasons, c.num_input_tokens, c.num_output_tokens) == \
        (["é x", ""], [None, "length"], 7, [2, 1])
    assert c.logprobs is None and c.prompt_logprobs is None
    c = parse_chunk(_response([("text_output", "BYTES", [b"a"]),
                               ("logprobs", "BYTES", [b'[{"5": {"logprob": -0.1, "rank": 1}}]'])]))
    assert (c.num_output_tokens, c.finish_reasons, c.num_input_tokens) == ([0], [None], 0)
    assert c.logprobs == [[{"5": {"logprob": -0.1, "rank": 1}}]]


def test_generations_spread_over_the_gateway_channels():
    """Each generation takes the channel with the fewest open streams; a finished one frees it."""
    import asyncio

    from tritium.frontend.triton_gateway import GenerationRequest, TritonGateway

    final = _response([("text_output", "BYTES", [b"x"])])
    final.parameters["triton_final_response"].bool_param = True

    class Result:
        def get_response(self):
            return final

    class FakeClient:
        def __init__(self):
            self.streams = 0

        def stream_infer(self, requests):
            self.streams += 1

            class Responses:  # Triton's answer to the request, once released
                def __aiter__(self):
                    return self

                async def __anext__(self):
                    await anext(requests)
                    await release.wait()
                    return Result(), None

                def cancel(self):
                    pass

            return Responses()

        async def close(self):
            pass

    async def main():
        gateway = TritonGateway("127.0.0.1:1", channels=3)
        for c in gateway.clients:
            await c.close()
        gateway.clients = [FakeClient(), FakeClient(), FakeClient()]

        async def one(i):
            req = GenerationRequest("m", f"r{i}", [1, 2], {}, stream=True)
            return [c.texts async for c in gateway.generate(req)]

        tasks = [asyncio.create_task(one(i)) for i in range(6)]
        await asyncio.sleep(0.05)
        assert [c.streams for c in gateway.clients] == [2, 2, 2]
        assert gateway.open_streams == [2, 2, 2]
        release.set()
        assert await asyncio.gather(*tasks) == [[["x"]]] * 6
        assert gateway.open_streams == [0, 0, 0]

    release = asyncio.Event()
    asyncio.run(main())


def test_the_gateway_reaches_a_triton_that_comes_up_late():
    """After seconds of a server that is down, the channel connects within about a second of the
    server coming up (gRPC's own backoff would leave it failing calls for several more)."""
    import asyncio
    import socket
    import time

    import grpc

    from tritium.frontend.triton_gateway import RECONNECT_BACKOFF_MS, TritonGateway

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        gateway = TritonGateway(f"127.0.0.1:{port}")
        channel = gateway.client._channel
        down_until = time.monotonic() + 6
        while time.monotonic() < down_until:  # clients retrying against a server still down
            assert not await gateway.is_live()
            await asyncio.sleep(0.1)
        server = grpc.aio.server()
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        up = time.monotonic()
        while channel.get_state() != grpc.ChannelConnectivity.READY and time.monotonic() - up < 10:
            await gateway.is_live()
            await asyncio.sleep(0.05)
        waited = time.monotonic() - up
        await gateway.close()
        await server.stop(None)
        limit = RECONNECT_BACKOFF_MS / 1000 * 1.5 + 0.3  # the backoff, its jitter, the polling
        assert waited < limit, f"connected {waited:.1f} s after the server came up"

    asyncio.run(main())


def test_engine_errors_are_renamed_to_the_fields_the_request_used():
    e = from_triton(_model_error("logprobs=21 is larger than max_logprobs=20.", ErrorKind.INVALID_ARGUMENT,
                                 "logprobs")).renamed({"logprobs": "top_logprobs"})
    assert (e.message, e.param, e.type) == ("top_logprobs=21 is larger than max_logprobs=20.", "top_logprobs",
                                            "invalid_request_error")
    other = from_triton(_model_error("top_p must be in (0, 1], got 1.5.", ErrorKind.INVALID_ARGUMENT, "top_p"))
    assert other.renamed({"logprobs": "top_logprobs"}) is other


def test_json_bodies_with_lone_surrogates_name_the_field():
    from tritium.frontend.json_body import decode_json_body

    assert decode_json_body(b'{"a": ["\\ud83d\\ude00", "\\u00e9"]}') == {"a": ["\U0001F600", "\u00e9"]}
    for raw, param in ((b'{"a": [1, {"b": "x\\udc00"}]}', "a.1.b"), (b'"\\ud800"', None),
                       (b'{"k\\ud800": 1}', None)):
        with pytest.raises(OpenAIError) as e:
            decode_json_body(raw)
        assert (e.value.status, e.value.param) == (400, param)
        assert "unpaired UTF-16 surrogate" in e.value.message
    with pytest.raises(OpenAIError, match="nests JSON arrays or objects too deeply"):
        decode_json_body(b"[" * 100_000 + b"]" * 100_000)


def test_metrics_pass_only_the_vllm_families_and_find_triton():
    from tritium.frontend.metrics import _is_vllm, default_triton_metrics_url

    text = ("# HELP nv_inference_count Number of inferences\n# TYPE nv_inference_count counter\n"
            'nv_inference_count{model="llm"} 3\n# HELP vllm:prompt_tokens_total Prompt tokens\n'
            '# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total{model="llm"} 7\n')
    assert [line for line in text.splitlines() if _is_vllm(line)] == [
        "# HELP vllm:prompt_tokens_total Prompt tokens", "# TYPE vllm:prompt_tokens_total counter",
        'vllm:prompt_tokens_total{model="llm"} 7']
    assert default_triton_metrics_url("triton.svc:8001") == "http://triton.svc:8002/metrics"
    assert default_triton_metrics_url("[::1]:8001") == "http://[::1]:8002/metrics"


def test_vllm_samples_get_the_model_name_label_of_the_served_name():
    from tritium.frontend.metrics import with_model_name

    names = {"llm": "meta-llama/Llama-3.1-8B"}
    assert [with_model_name(line, names) for line in (
        'vllm:num_requests_running{model="llm",version="1"} 0',
        'vllm:e2e_request_latency_seconds_bucket{le="0.5",model="llm",model_name="llm",version="1"} 3',
        'vllm:lora_requests_info{max_lora="2",model="llm",running_lora_adapters="a,b}",version="1"} 1.7e+09',
        'vllm:num_requests_waiting{model="other\\"q",version="1"} 2',
        'vllm:no_labels 3', 'vllm:no_model{position="0"} 1', '# HELP vllm:x {model="llm"}')] == [
        'vllm:num_requests_running{model="llm",version="1",model_name="meta-llama/Llama-3.1-8B"} 0',
        'vllm:e2e_request_latency_seconds_bucket{le="0.5",model="llm",model_name="meta-llama/Llama-3.1-8B",version="1"} 3',
        'vllm:lora_requests_info{max_lora="2",model="llm",running_lora_adapters="a,b}",version="1",'
        'model_name="meta-llama/Llama-3.1-8B"} 1.7e+09',
        'vllm:num_requests_waiting{model="other\\"q",version="1",model_name="other\\"q"} 2',
        'vllm:no_labels 3', 'vllm:no_model{position="0"} 1', '# HELP vllm:x {model="llm"}']


def test_the_frontend_speaks_the_models_info_contract():
    from tritium.serving.triton_request import MODEL_INFO as BACKEND_MODEL_INFO
    from tritium.frontend.triton_gateway import MODEL_INFO

    assert MODEL_INFO == BACKEND_MODEL_INFO


def test_served_model_names_need_one_triton_model():
    from tritium.frontend.cli import config_from, parse_args

    config = config_from(parse_args(["--model", "llm", "--served-model-name", "org/m", "m"]))
    assert (config.models, config.served_model_names) == (("llm",), ("org/m", "m"))
    for argv in (["--served-model-name", "org/m"], ["--model", "a", "--model", "b", "--served-model-name", "m"]):
        with pytest.raises(SystemExit, match=r"^python -m frontend: --served-model-name names one Triton "
                                             r"model: give it with one --model \(got [02]\)$"):
            config_from(parse_args(argv))


def test_stream_options_need_stream_and_content_parts_must_be_text():
    with pytest.raises(OpenAIError, match="Stream options can only be defined when `stream=True`."):
        chat(stream_options={"include_usage": True})
    assert chat(stream=True, stream_options={"include_usage": True}) == {"n": 1, "max_tokens": None}
    image = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(OpenAIError, match=r"^messages.0.content: part 1 is an image \(type 'image_url'\)"):
        parse_body(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": image}]})


def test_tokenize_refuses_a_chat_template_of_the_requests_own():
    import asyncio

    from tritium.frontend.tokenization import Tokenization

    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ messages }}"}
    with pytest.raises(OpenAIError) as info:
        asyncio.run(Tokenization(None).tokenize(body))
    assert (info.value.status, info.value.message, info.value.param) == (
        400, "chat_template is not supported by this server", "chat_template")
