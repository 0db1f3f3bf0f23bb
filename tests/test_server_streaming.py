"""Must-show 1 and 2: the real tritonserver streams what the offline engine generates, over gRPC
and HTTP, and 64 concurrent streams each end with exactly one FINAL and all their tokens."""
import json
import os
import re
import subprocess
import sys

import pytest

from tritium import LLM, SamplingParams
from triton_server import (ROOT, TEST_ENGINE_ARGS, StreamCollector, grpc_inputs, http_request,
                           sse_events)

PROMPTS = ["Hello world", "The capital of France is", "Once upon a time, in a land far away,"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def offline(tiny_model):
    """The offline engine's greedy completions, with the server's engine arguments."""
    args = {k: v for k, v in TEST_ENGINE_ARGS.items()}
    llm = LLM(tiny_model, dtype=args["dtype"], num_kv_blocks=int(args["num_kv_blocks"]),
              block_size=int(args["block_size"]), max_model_len=int(args["max_model_len"]))
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return {p: o.outputs[0] for p, o in zip(PROMPTS, outs)}


def test_grpc_stream_equals_the_offline_engine(llm_server, offline):
    stream = StreamCollector(llm_server.grpc_url)
    try:
        for i, prompt in enumerate(PROMPTS):
            stream.send(f"s{i}", grpc_inputs(prompt, sampling={"temperature": 0, "max_tokens": MAX_TOKENS},
                                             stream=True, return_num_output_tokens=True,
                                             return_finish_reason=True))
        for i, prompt in enumerate(PROMPTS):
            r = stream.wait(f"s{i}")
            expected = offline[prompt]
            assert r.text == expected.text
            assert sum(r.num_output_tokens) == len(expected.token_ids) == MAX_TOKENS
            # Streamed as generated: several responses, none empty (a response carries more than
            # one token only when the sender thread fell behind the engine and folded them).
            assert len(r.num_output_tokens) > 1 and min(r.num_output_tokens) >= 1
            assert r.finish_reasons[-1] == expected.finish_reason == "length"
            assert (r.finals, r.after_final) == (1, 0)
        assert stream.errors.empty()
    finally:
        stream.close()


def test_grpc_non_streaming_includes_the_prompt(llm_server, offline):
    stream = StreamCollector(llm_server.grpc_url)
    try:
        prompt = PROMPTS[1]
        stream.send("full", grpc_inputs(prompt, sampling={"temperature": 0, "max_tokens": MAX_TOKENS}))
        stream.send("excl", grpc_inputs(prompt, sampling={"temperature": 0, "max_tokens": MAX_TOKENS},
                                        exclude_input_in_output=True))
        full, excl = stream.wait("full"), stream.wait("excl")
        assert full.texts == [prompt + offline[prompt].text]
        assert excl.texts == [offline[prompt].text]
    finally:
        stream.close()


def test_http_generate_and_generate_stream(llm_server, offline):
    prompt = PROMPTS[2]
    # Top-level keys that are not inputs arrive as request parameters: the sampling parameters.
    status, body = http_request(f"{llm_server.http_url}/v2/models/llm/generate",
                                {"text_input": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                 "exclude_input_in_output": True})
    assert status == 200, body
    import json
    assert json.loads(body)["text_output"] == offline[prompt].text

    status, body = http_request(f"{llm_server.http_url}/v2/models/llm/generate_stream",
                                {"text_input": prompt, "stream": True,
                                 "parameters": {"max_tokens": MAX_TOKENS, "temperature": 0}})
    assert status == 200, body
    events = sse_events(body)
    assert "".join(e["text_output"] for e in events) == offline[prompt].text
    assert len(events) > 1


def test_input_ids_prompt(llm_server, offline, tiny_model):
    from transformers import AutoTokenizer

    prompt = PROMPTS[0]
    ids = AutoTokenizer.from_pretrained(tiny_model)(prompt)["input_ids"]
    stream = StreamCollector(llm_server.grpc_url)
    try:
        stream.send("ids", grpc_inputs(input_ids=ids, sampling={"temperature": 0, "max_tokens": MAX_TOKENS},
                                       stream=True))
        assert stream.wait("ids").text == offline[prompt].text
    finally:
        stream.close()


def test_64_concurrent_streams_each_end_once_with_all_tokens(llm_server):
    stream = StreamCollector(llm_server.grpc_url)
    wanted = {f"c{i}": 8 + i % 25 for i in range(64)}
    try:
        for rid, n in wanted.items():
            stream.send(rid, grpc_inputs(f"request {rid}: tell me something", stream=True,
                                         sampling={"max_tokens": n, "ignore_eos": True, "temperature": 0.8,
                                                   "seed": int(rid[1:])},
                                         return_num_output_tokens=True, return_finish_reason=True))
        for rid, n in wanted.items():
            r = stream.wait(rid, timeout=300)
            assert (r.finals, r.after_final) == (1, 0), rid
            assert sum(r.num_output_tokens) == n, rid
            assert r.finish_reasons[-1] == "length", rid
        assert stream.errors.empty()
    finally:
        stream.close()


def test_cli_client_streams_the_offline_text(llm_server, offline):
    prompt = PROMPTS[0]
    out = subprocess.run([sys.executable, "-m", "tritium.client", "--url", llm_server.grpc_url, "--temperature", "0",
                          "--max-tokens", str(MAX_TOKENS), prompt],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == offline[prompt].text + "\n"
    http = subprocess.run([sys.executable, "-m", "tritium.client", "--http", "--url", llm_server.http_url.split("//")[1],
                           "--temperature", "0", "--max-tokens", str(MAX_TOKENS), prompt],
                          capture_output=True, text=True, timeout=120)
    assert http.returncode == 0, http.stderr
    assert http.stdout == offline[prompt].text + "\n"


def test_new_sampling_parameters_through_the_server(llm_server, tiny_model):
    """logit_bias (OpenAI's string keys), allowed_token_ids, bad_words, truncate_prompt_tokens
    and structured outputs reach the engine in its own process: the server streams what the
    offline engine makes."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    args = dict(TEST_ENGINE_ARGS)
    llm = LLM(tiny_model, dtype=args["dtype"], num_kv_blocks=int(args["num_kv_blocks"]),
              block_size=int(args["block_size"]), max_model_len=int(args["max_model_len"]))
    prompt = PROMPTS[2]
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].outputs[0]
    word = tok.decode(base.token_ids[:2])
    cases = {"bias": {"logit_bias": {str(base.token_ids[0]): -50.0, "300": 7.5}},
             "allowed": {"allowed_token_ids": [base.token_ids[1], 300, 301]},
             "bad": {"bad_words": [word]},
             "trunc": {"truncate_prompt_tokens": 4},
             # Structured outputs under both names, as an object and as a JSON string.
             "choice": {"guided_decoding": {"choice": ["red", "green", "blue"]}},
             "regex": {"structured_outputs": json.dumps({"regex": "[a-z]{2,6}-[0-9]{2}"})}}
    stream = StreamCollector(llm_server.grpc_url)
    try:
        for name, extra in cases.items():
            stream.send(name, grpc_inputs(prompt, sampling={"temperature": 0, "max_tokens": MAX_TOKENS, **extra},
                                          stream=True))
        for name, extra in cases.items():
            params = SamplingParams.from_dict({"temperature": 0, "max_tokens": MAX_TOKENS, **extra})
            want = llm.generate([prompt], params)[0]
            assert stream.wait(name).text == want.outputs[0].text, name
            assert want.outputs[0].token_ids != base.token_ids, name  # each parameter changed the output
        assert stream.results["choice"].text in ("red", "green", "blue")
        assert re.fullmatch("[a-z]{2,6}-[0-9]{2}", stream.results["regex"].text)
        assert stream.errors.empty()
    finally:
        stream.close()


def test_prompt_logprobs_through_the_server(llm_server, tiny_model):
    """prompt_logprobs reach the engine process and come back as JSON: once in a stream (with
    the first token), in the single response otherwise, equal to the offline engine's."""
    import json

    args = dict(TEST_ENGINE_ARGS)
    llm = LLM(tiny_model, dtype=args["dtype"], num_kv_blocks=int(args["num_kv_blocks"]),
              block_size=int(args["block_size"]), max_model_len=int(args["max_model_len"]))
    prompt = PROMPTS[2]
    sampling = {"temperature": 0, "max_tokens": 8, "prompt_logprobs": 2}
    want = llm.generate([prompt], SamplingParams(**sampling))[0]
    stream = StreamCollector(llm_server.grpc_url)
    try:
        stream.send("streamed", grpc_inputs(prompt, sampling=sampling, stream=True))
        stream.send("whole", grpc_inputs(prompt, sampling=sampling))
        streamed, whole = stream.wait("streamed"), stream.wait("whole")
        assert stream.errors.empty()
    finally:
        stream.close()
    assert [i for i, _ in streamed.prompt_logprobs] == [0] and len(streamed.texts) > 1
    assert len(whole.prompt_logprobs) == 1 and streamed.text == want.outputs[0].text
    for _, text in streamed.prompt_logprobs + whole.prompt_logprobs:
        got = json.loads(text)
        assert len(got) == len(want.prompt_token_ids) and got[0] is None
        for entry, expected in zip(got[1:], want.prompt_logprobs[1:]):
            assert {int(t) for t in entry} == set(expected)
            for t, lp in expected.items():
                assert entry[str(t)]["rank"] == lp.rank
                # made in the server's receiver from the tokenizer, as the offline engine makes it
                assert lp.decoded_token is not None
                assert entry[str(t)]["decoded_token"] == lp.decoded_token
                assert entry[str(t)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
