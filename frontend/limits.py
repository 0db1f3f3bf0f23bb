"""The largest size of everything a client's request sets, in one place. Each is checked before
anything is built from it: a count of choices, list items or characters that nothing bounded
would let one request grow this process without end (n = 10^9 built a billion per-choice lists
before the engine could refuse it). The Triton door has its own (backend/serving/request_limits.py)."""
from __future__ import annotations

import json
from typing import Any

from tritium.frontend.errors import OpenAIError, bad_request

MAX_BODY_BYTES = 16 * 2**20  # a request body, read in pieces up to this
MAX_N = 128  # OpenAI's largest n; best_of too
MAX_LOGPROBS = 20  # OpenAI's largest top_logprobs, vLLM's default max_logprobs (the engine's)
# max_tokens where the model's max_model_len is not known: above any model's context window.
MAX_TOKENS = 2**24
MAX_PROMPT_CHARS = 4 * 2**20  # a prompt's text (chat: its messages'), before tokenizing
MAX_PROMPT_TOKENS = 2**20  # a prompt given as token ids
MAX_PROMPTS = 128  # prompts in one completions request
MAX_MESSAGES = 2048  # OpenAI's
MAX_TOOLS = 128  # OpenAI's
MAX_STOP = 64  # stop strings
MAX_WORDS = 1024  # bad_words; guided_choice's choices
MAX_STRING_CHARS = 1024  # each stop string, bad word or choice
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_TOKEN_IDS = 2**18  # stop_token_ids, allowed_token_ids: the largest vocabularies
# kv_transfer_params as JSON: room for a prefill instance's block ids of the longest prompt and
# its NIXL metadata, which the proxy passes on unchanged.
MAX_KV_TRANSFER_PARAMS_CHARS = 4 * 2**20


def check_collection_sizes(body: dict[str, Any]) -> None:
    """The lists, objects and strings of a decoded body, before its fields are validated (which
    builds an object per item). A field of the wrong type is left to validation to name."""
    _strings(body, "stop", MAX_STOP)
    _strings(body, "bad_words", MAX_WORDS)
    _strings(body, "guided_choice", MAX_WORDS)
    structured = body.get("structured_outputs")
    if isinstance(structured, dict) and isinstance(structured.get("choice"), list):
        _strings(structured, "choice", MAX_WORDS, "structured_outputs.choice")
    for name in ("stop_token_ids", "allowed_token_ids"):
        _count(body, name, MAX_TOKEN_IDS, "token ids")
    _count(body, "logit_bias", MAX_LOGIT_BIAS, "entries")
    _count(body, "tools", MAX_TOOLS, "tools")
    _count(body, "input", MAX_MESSAGES, "items")  # /v1/responses' messages and calls
    _json_length(body, "kv_transfer_params", MAX_KV_TRANSFER_PARAMS_CHARS)
    if _count(body, "messages", MAX_MESSAGES, "messages"):
        chars = sum(_content_chars(m.get("content")) for m in body["messages"] if isinstance(m, dict))
        if chars > MAX_PROMPT_CHARS:
            raise bad_request(f"messages may hold at most {MAX_PROMPT_CHARS} characters of content, "
                              f"got {chars}.", "messages")
    if "prompt" in body:
        _check_prompt(body["prompt"])


def check_values(req: Any) -> None:
    """The numbers of a validated request that size what is built for it."""
    for name in ("n", "best_of"):
        value = getattr(req, name, None)
        if value is not None and value > MAX_N:
            raise bad_request(f"{name} must be at most {MAX_N}, got {value}.", name)
    # Chat's logprobs is a boolean, completions' a count; the engine's words for its range.
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        value = getattr(req, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= MAX_LOGPROBS:
            raise bad_request(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}.", name)


def check_max_tokens(req: Any, max_model_len: int | None) -> None:
    """max_tokens (or chat's max_completion_tokens) at most the model's max_model_len where
    known, else MAX_TOKENS; the engine checks the prompt plus it."""
    limit = max_model_len or MAX_TOKENS
    why = " (the model's max_model_len)" if max_model_len else ""
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, name, None)
        if value is not None and value > limit:
            raise bad_request(f"{name} must be at most {limit}{why}, got {value}.", name)


def check_prompt_text(text: str) -> None:
    """A chat prompt as the template made it (tools and markup added), before tokenizing."""
    if len(text) > MAX_PROMPT_CHARS:
        raise bad_request(f"the prompt (the messages through the chat template) may have at most "
                          f"{MAX_PROMPT_CHARS} characters, got {len(text)}.", "messages")


def body_too_large(limit: int = MAX_BODY_BYTES) -> OpenAIError:
    return OpenAIError(413, f"the request body is larger than the limit of {limit} bytes.")


def _count(body: dict[str, Any], name: str, limit: int, what: str) -> bool:
    """Whether body[name] is a list or object (then checked against `limit`)."""
    value = body.get(name)
    if not isinstance(value, (list, dict)):
        return False
    if len(value) > limit:
        raise bad_request(f"{name} may hold at most {limit} {what}, got {len(value)}.", name)
    return True


def _json_length(body: dict[str, Any], name: str, limit: int) -> None:
    """body[name], an object, at most `limit` characters as JSON (it is forwarded as JSON)."""
    value = body.get(name)
    if not isinstance(value, dict):
        return
    try:
        length = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))
    except RecursionError:
        raise bad_request(f"{name} nests JSON arrays or objects too deeply", name) from None
    if length > limit:
        raise bad_request(f"{name} may have at most {limit} characters as JSON, got {length}.", name)


def _strings(body: dict[str, Any], key: str, limit: int, name: str | None = None) -> None:
    """body[key]: a string or a list of strings (`name`: the field's path, for the message)."""
    name = name or key
    param = name.split(".")[0]
    value = body.get(key)
    items = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    if len(items) > limit:
        raise bad_request(f"{name} may hold at most {limit} strings, got {len(items)}.", param)
    for i, s in enumerate(items):
        if isinstance(s, str) and len(s) > MAX_STRING_CHARS:
            where = f"{name}[{i}]" if isinstance(value, list) else name
            raise bad_request(f"{where} may have at most {MAX_STRING_CHARS} characters, got {len(s)}.",
                              param)


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def _check_prompt(prompt: Any) -> None:
    """A string, token ids, or a list of either: how many prompts, each one's length."""
    if isinstance(prompt, str):
        _prompt_length(prompt, "prompt")
        return
    if not isinstance(prompt, list) or not prompt:
        return
    if isinstance(prompt[0], int):  # one prompt of token ids (validation checks the rest are ints)
        _prompt_length(prompt, "prompt")
        return
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"prompt may hold at most {MAX_PROMPTS} prompts, got {len(prompt)}.", "prompt")
    for i, one in enumerate(prompt):
        _prompt_length(one, f"prompt[{i}]")


def _prompt_length(prompt: Any, where: str) -> None:
    if isinstance(prompt, str) and len(prompt) > MAX_PROMPT_CHARS:
        raise bad_request(f"{where} may have at most {MAX_PROMPT_CHARS} characters, got {len(prompt)}.",
                          "prompt")
    if isinstance(prompt, list) and len(prompt) > MAX_PROMPT_TOKENS:
        raise bad_request(f"{where} may have at most {MAX_PROMPT_TOKENS} token ids, got {len(prompt)}.",
                          "prompt")
