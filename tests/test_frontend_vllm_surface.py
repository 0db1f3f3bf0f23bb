"""What clients of vLLM's server read from it besides completions, through the frontend in front
of the real tritonserver (the shared chat_stack): /v1/models' cards, /tokenize and /detokenize
(with the model's tokenizer, agreeing with the engine's own token counts), /version, /ping, and
the model_name label on the vllm: metrics. Served names and LoRA adapters as models are in
tests/test_server_lora.py, whose server has adapters."""
import httpx
import pytest

from tritium import frontend
from tritium.engine.tokenizer import load_tokenizer
from triton_server import TEST_ENGINE_ARGS

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
TEMPLATED = "<|begin_of_text|><|system|>\nBe brief.<|end_of_text|>\n<|user|>\nHi<|end_of_text|>\n<|assistant|>\n"


@pytest.fixture(scope="module")
def stack(chat_stack):
    server, fe, model, _ = chat_stack
    return server, fe.url, model


@pytest.fixture(scope="module")
def tokenizer(stack):
    return load_tokenizer(stack[2])


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url, json=body, timeout=120)


def _card(card: dict) -> dict:
    """A card with its per-response parts (times, the permission's random id) checked and removed."""
    (permission,) = card.pop("permission")
    assert permission.pop("id").startswith("modelperm-") and permission.pop("created") == card.pop("created")
    assert permission == {"object": "model_permission", "allow_create_engine": False, "allow_sampling": True,
                          "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                          "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}
    return card


def test_models_are_listed_as_vllm_cards(stack):
    _, url, model = stack
    listed = httpx.get(url + "/v1/models", timeout=60).json()
    assert listed["object"] == "list" and len(listed["data"]) == 1
    # root: the model's directory as the engine resolved it; max_model_len: the engine's.
    expected = {"id": "llm", "object": "model", "owned_by": "tritium", "root": model, "parent": None,
                "max_model_len": int(TEST_ENGINE_ARGS["max_model_len"])}
    assert _card(listed["data"][0]) == expected
    assert _card(httpx.get(url + "/v1/models/llm", timeout=60).json()) == expected


def test_an_unknown_model_is_a_404_in_vllms_words(stack):
    _, url, _ = stack
    error = {"error": {"message": "The model `gpt-4` does not exist.", "type": "not_found_error",
                       "param": "model", "code": "model_not_found"}}
    for r in (httpx.get(url + "/v1/models/gpt-4", timeout=60),
              _post(url + "/v1/completions", {"model": "gpt-4", "prompt": "Hi", "max_tokens": 1}),
              _post(url + "/v1/chat/completions", {"model": "gpt-4", "messages": MESSAGES}),
              _post(url + "/tokenize", {"model": "gpt-4", "prompt": "Hi"})):
        assert (r.status_code, r.json()) == (404, error)


def test_tokenize_gives_the_token_ids_the_engine_counts(stack, tokenizer):
    _, url, _ = stack
    r = _post(url + "/tokenize", {"model": "llm", "prompt": "Hello world", "return_token_strs": True})
    ids = tokenizer.encode("Hello world", add_special_tokens=True)
    assert r.status_code == 200 and ids[0] == tokenizer.bos_token_id
    assert r.json() == {"count": len(ids), "max_model_len": 1024, "tokens": ids,
                        "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    assert r.json()["token_strs"][0] == "<|begin_of_text|>"
    # Without the BOS, and without the model's name (this frontend serves one model).
    r = _post(url + "/tokenize", {"prompt": "Hello world", "add_special_tokens": False})
    assert r.json() == {"count": len(ids) - 1, "max_model_len": 1024, "tokens": ids[1:], "token_strs": None}
    completion = _post(url + "/v1/completions", {"model": "llm", "prompt": "Hello world", "max_tokens": 1})
    assert completion.json()["usage"]["prompt_tokens"] == len(ids)  # the engine's own count


def test_tokenize_messages_through_the_chat_template(stack, tokenizer):
    _, url, _ = stack
    r = _post(url + "/tokenize", {"model": "llm", "messages": MESSAGES})
    ids = tokenizer.encode(TEMPLATED, add_special_tokens=False)  # the template holds the BOS
    assert r.json() == {"count": len(ids), "max_model_len": 1024, "tokens": ids, "token_strs": None}
    chat = _post(url + "/v1/chat/completions", {"model": "llm", "messages": MESSAGES, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == len(ids)
    assert _post(url + "/detokenize", {"model": "llm", "tokens": ids}).json() == {"prompt": TEMPLATED}
    # Without the generation prompt, the conversation ends with the last message.
    r = _post(url + "/tokenize", {"model": "llm", "messages": MESSAGES, "add_generation_prompt": False})
    without = TEMPLATED.removesuffix("<|assistant|>\n")
    assert r.json()["tokens"] == tokenizer.encode(without, add_special_tokens=False)


def test_detokenize_and_its_refusals(stack, tokenizer):
    _, url, _ = stack
    ids = tokenizer.encode("Hello world", add_special_tokens=True)
    assert _post(url + "/detokenize", {"model": "llm", "tokens": ids}).json() == {
        "prompt": "<|begin_of_text|>Hello world"}  # special tokens kept, as vLLM
    r = _post(url + "/detokenize", {"model": "llm", "tokens": [5, 512]})
    assert (r.status_code, r.json()["error"]["message"], r.json()["error"]["param"]) == (
        400, "tokens: token id 512 is out of vocabulary (valid ids are 0 to 511).", "tokens")
    r = _post(url + "/detokenize", {"model": "llm", "tokens": [1] * (2**20 + 1)})
    assert (r.status_code, r.json()["error"]["message"]) == (
        400, "tokens may hold at most 1048576 token ids, got 1048577.")
    r = _post(url + "/tokenize", {"model": "llm"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "prompt")


def test_version_and_ping(stack):
    _, url, _ = stack
    assert httpx.get(url + "/version", timeout=30).json() == {"version": frontend.__version__}
    assert frontend.__version__ == "0.1.0"
    for method in ("GET", "POST"):
        r = httpx.request(method, url + "/ping", timeout=60)
        assert (r.status_code, r.json()) == (200, {"status": "ok", "models": ["llm"]})


def test_vllm_metrics_carry_model_name_at_both_doors(stack):
    server, url, _ = stack
    _post(url + "/v1/completions", {"model": "llm", "prompt": "Hi", "max_tokens": 2})
    labels = {"model": "llm", "model_name": "llm", "version": "1"}
    assert server.metric("vllm:generation_tokens_total", **labels) > 0  # Triton's endpoint
    text = httpx.get(url + "/metrics", timeout=60).text  # the frontend's, passed on
    running = [line for line in text.splitlines() if line.startswith("vllm:num_requests_running{")]
    assert running == ['vllm:num_requests_running{model="llm",model_name="llm",version="1"} 0']


def test_the_model_describes_itself_at_the_triton_door(stack):
    """The `model_info` request parameter the frontend asks with, on Triton's HTTP generate
    endpoint: no inputs, no generation, one response."""
    import json

    from triton_server import http_request

    server, _, model = stack
    status, body = http_request(f"{server.http_url}/v2/models/llm/generate", {"model_info": True})
    assert status == 200, body
    response = json.loads(body)
    assert json.loads(response.pop("text_output")) == {"model": model, "max_model_len": 1024, "lora_modules": {}}
    assert response == {"model_name": "llm", "model_version": "1"}
