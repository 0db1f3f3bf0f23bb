"""The OpenAI frontend's bounds on every size a request sets (frontend/limits.py), in-process:
each refused with a 400 naming the field and the limit before anything is built from it."""
import asyncio

import pytest

from tritium.serving import request_limits
from tritium.frontend import limits
from tritium.frontend.errors import OpenAIError
from tritium.frontend.json_body import decode_json_body, read_body
from tritium.frontend.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from tritium.frontend.responses_request import ResponsesRequest

MSG = [{"role": "user", "content": "Hi"}]
CHAT = {"model": "m", "messages": MSG}
COMP = {"model": "m", "prompt": "Hi"}
TOOL = {"type": "function", "function": {"name": "f"}}

# (request class, body, param, the exact message)
OVERSIZED = [
    (ChatCompletionRequest, {**CHAT, "n": 10**9}, "n", "n must be at most 128, got 1000000000."),
    (CompletionRequest, {**COMP, "n": "129"}, "n", "n must be at most 128, got 129."),
    (CompletionRequest, {**COMP, "best_of": 10**9}, "best_of", "best_of must be at most 128, got 1000000000."),
    (ChatCompletionRequest, {**CHAT, "logprobs": True, "top_logprobs": 10**9}, "top_logprobs",
     "top_logprobs must be in [0, 20], got 1000000000."),
    (CompletionRequest, {**COMP, "logprobs": 21}, "logprobs", "logprobs must be in [0, 20], got 21."),
    (CompletionRequest, {**COMP, "prompt_logprobs": 21}, "prompt_logprobs",
     "prompt_logprobs must be in [0, 20], got 21."),
    (ChatCompletionRequest, {**CHAT, "stop": ["a"] * 100_000}, "stop",
     "stop may hold at most 64 strings, got 100000."),
    (ChatCompletionRequest, {**CHAT, "stop": "x" * 1025}, "stop", "stop may have at most 1024 characters, got 1025."),
    (CompletionRequest, {**COMP, "stop": ["a", "x" * 1025]}, "stop",
     "stop[1] may have at most 1024 characters, got 1025."),
    (ChatCompletionRequest, {**CHAT, "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias",
     "logit_bias may hold at most 1024 entries, got 1025."),
    (CompletionRequest, {**COMP, "stop_token_ids": [1] * (2**18 + 1)}, "stop_token_ids",
     "stop_token_ids may hold at most 262144 token ids, got 262145."),
    (CompletionRequest, {**COMP, "allowed_token_ids": [1] * (2**18 + 1)}, "allowed_token_ids",
     "allowed_token_ids may hold at most 262144 token ids, got 262145."),
    (CompletionRequest, {**COMP, "bad_words": ["w"] * 1025}, "bad_words",
     "bad_words may hold at most 1024 strings, got 1025."),
    (CompletionRequest, {**COMP, "bad_words": ["x" * 1025]}, "bad_words",
     "bad_words[0] may have at most 1024 characters, got 1025."),
    (CompletionRequest, {**COMP, "guided_choice": ["c"] * 1025}, "guided_choice",
     "guided_choice may hold at most 1024 strings, got 1025."),
    (CompletionRequest, {**COMP, "structured_outputs": {"choice": ["c"] * 1025}}, "structured_outputs",
     "structured_outputs.choice may hold at most 1024 strings, got 1025."),
    # Counted before validation builds a message object per item (these would each fail it).
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": "bogus"}] * 2049}, "messages",
     "messages may hold at most 2048 messages, got 2049."),
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": "x" * 2**21},
                                                  {"role": "user", "content": [{"type": "text", "text": "y" * 2**21}]},
                                                  {"role": "user", "content": "z"}]}, "messages",
     "messages may hold at most 4194304 characters of content, got 4194305."),
    (ChatCompletionRequest, {**CHAT, "tools": [TOOL] * 129}, "tools", "tools may hold at most 128 tools, got 129."),
    (ResponsesRequest, {"model": "m", "input": [{"role": "bogus"}] * 2049}, "input",
     "input may hold at most 2048 items, got 2049."),
    (CompletionRequest, {**COMP, "prompt": "x" * (4 * 2**20 + 1)}, "prompt",
     "prompt may have at most 4194304 characters, got 4194305."),
    (CompletionRequest, {**COMP, "prompt": [7] * (2**20 + 1)}, "prompt",
     "prompt may have at most 1048576 token ids, got 1048577."),
    (CompletionRequest, {**COMP, "prompt": ["a"] * 129}, "prompt", "prompt may hold at most 128 prompts, got 129."),
    (CompletionRequest, {**COMP, "prompt": [[1], [7] * (2**20 + 1)]}, "prompt",
     "prompt[1] may have at most 1048576 token ids, got 1048577."),
    (CompletionRequest, {**COMP, "prompt": ["a", "x" * (4 * 2**20 + 1)]}, "prompt",
     "prompt[1] may have at most 4194304 characters, got 4194305."),
]


@pytest.mark.parametrize("cls, body, param, message", OVERSIZED,
                         ids=[f"{i}-{case[2]}" for i, case in enumerate(OVERSIZED)])
def test_each_size_is_refused_naming_the_field_and_its_limit(cls, body, param, message):
    with pytest.raises(OpenAIError) as e:
        parse_body(cls, body)
    assert (e.value.status, e.value.param, e.value.message, e.value.type) == (
        400, param, message, "invalid_request_error")


def test_sizes_at_their_limits_are_accepted():
    req = parse_body(ChatCompletionRequest, {
        **CHAT, "n": 128, "logprobs": True, "top_logprobs": 20, "stop": ["s" * 1024] * 64,
        "logit_bias": {str(i): 1 for i in range(1024)}, "tools": [TOOL] * 128, "messages": MSG * 2048})
    assert (req.n, len(req.stop), len(req.logit_bias), len(req.tools), len(req.messages)) == (128, 64, 1024, 128, 2048)
    req = parse_body(CompletionRequest, {**COMP, "best_of": 128, "n": 128, "logprobs": 20,
                                         "prompt": [[1] * 2**20] + [[2]] * 127, "guided_choice": ["c"] * 1024})
    assert (req.n, len(req.prompt), len(req.prompt[0]), len(req.guided_choice)) == (128, 128, 2**20, 1024)


def test_max_tokens_is_bounded_by_the_models_max_model_len_where_known():
    req = parse_body(ChatCompletionRequest, {**CHAT, "max_completion_tokens": 1025})
    with pytest.raises(OpenAIError) as e:
        limits.check_max_tokens(req, 1024)
    assert (e.value.param, e.value.message) == (
        "max_completion_tokens", "max_completion_tokens must be at most 1024 (the model's max_model_len), got 1025.")
    limits.check_max_tokens(req, None)  # no max_model_len in the model's config: MAX_TOKENS
    req = parse_body(CompletionRequest, {**COMP, "max_tokens": 2**24 + 1})
    with pytest.raises(OpenAIError) as e:
        limits.check_max_tokens(req, None)
    assert (e.value.param, e.value.message) == ("max_tokens", "max_tokens must be at most 16777216, got 16777217.")
    limits.check_max_tokens(parse_body(CompletionRequest, {**COMP, "max_tokens": 1024}), 1024)


def test_a_templated_prompt_is_bounded_before_tokenizing():
    limits.check_prompt_text("x" * limits.MAX_PROMPT_CHARS)
    with pytest.raises(OpenAIError) as e:
        limits.check_prompt_text("x" * (limits.MAX_PROMPT_CHARS + 1))
    assert (e.value.param, e.value.message) == ("messages", "the prompt (the messages through the chat template) "
                                                "may have at most 4194304 characters, got 4194305.")


def test_the_body_is_read_up_to_its_limit_only():
    async def pieces(sizes, taken):
        for size in sizes:
            taken.append(size)
            yield b"x" * size

    async def read(sizes, length=None, limit=10):
        taken: list[int] = []
        try:
            return await read_body(pieces(sizes, taken), length, limit), taken
        except OpenAIError as e:
            return e, taken

    assert asyncio.run(read([4, 6])) == (b"x" * 10, [4, 6])
    error, taken = asyncio.run(read([4, 6, 1, 100, 100]))
    assert (error.status, error.message, error.type, taken) == (
        413, "the request body is larger than the limit of 10 bytes.", "invalid_request_error", [4, 6, 1])
    error, taken = asyncio.run(read([4], length="11"))  # Content-Length says so: nothing is read
    assert (error.status, taken) == (413, [])
    assert limits.MAX_BODY_BYTES == 16 * 2**20


def test_an_integer_too_long_for_python_is_a_400_not_a_500():
    with pytest.raises(OpenAIError) as e:
        decode_json_body(b'{"n": ' + b"1" * 5000 + b"}")
    assert e.value.status == 400
    assert e.value.message.startswith("the request body is not valid JSON: Exceeds the limit (4300 digits)")


def test_both_doors_have_the_same_limits():
    shared = ("MAX_N", "MAX_PROMPT_CHARS", "MAX_PROMPT_TOKENS", "MAX_STOP", "MAX_WORDS", "MAX_STRING_CHARS",
              "MAX_LOGIT_BIAS", "MAX_TOKEN_IDS")
    assert {k: getattr(limits, k) for k in shared} == {k: getattr(request_limits, k) for k in shared}
