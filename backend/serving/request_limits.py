"""The largest size of everything a Triton request sets, in one place. parse_request checks each
before anything is built from it: the engine's own checks (n against max_num_seqs, the prompt
and max_tokens against max_model_len, logprobs at most 20) come after the per-sample response
state exists and the prompt is tokenized, so n = 2,000,000 took seconds to refuse. The OpenAI
frontend's door has the same limits (frontend/limits.py)."""
from __future__ import annotations

import json
from typing import Any, Mapping

from tritium.errors import ParameterError

MAX_N = 128  # OpenAI's largest n; best_of too
MAX_PROMPT_CHARS = 4 * 2**20  # text_input, before tokenizing
MAX_PROMPT_TOKENS = 2**20  # input_ids
MAX_SAMPLING_PARAMETERS_CHARS = 16 * 2**20  # the sampling_parameters JSON, before decoding it
MAX_STOP = 64  # stop strings
MAX_WORDS = 1024  # bad_words; structured_outputs' choices
MAX_STRING_CHARS = 1024  # each stop string, bad word or choice
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_TOKEN_IDS = 2**18  # stop_token_ids, allowed_token_ids: the largest vocabularies


def check_sampling_sizes(sampling: Mapping[str, Any]) -> None:
    """The sizes among a request's sampling parameters as received (JSON types, or strings as
    genai-perf sends them). A value of the wrong type is left to SamplingParams to name."""
    for name in ("n", "best_of"):
        value = _integer(sampling.get(name))
        if value is not None and value > MAX_N:
            raise ParameterError(f"{name} must be at most {MAX_N}, got {value}.", name)
    _strings(sampling, "stop", MAX_STOP)
    _strings(sampling, "bad_words", MAX_WORDS)
    for key in ("structured_outputs", "guided_decoding"):
        spec = _decoded(sampling.get(key), "{")
        if isinstance(spec, dict):
            _strings(spec, "choice", MAX_WORDS, f"{key}.choice")
    for name in ("stop_token_ids", "allowed_token_ids"):
        _count(sampling, name, MAX_TOKEN_IDS, "token ids")
    _count(sampling, "logit_bias", MAX_LOGIT_BIAS, "entries")


def check_text_input(prompt: str) -> None:
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ParameterError(f"text_input may have at most {MAX_PROMPT_CHARS} characters, got {len(prompt)}.",
                             "text_input")


def check_input_ids(count: int) -> None:
    if count > MAX_PROMPT_TOKENS:
        raise ParameterError(f"input_ids may have at most {MAX_PROMPT_TOKENS} token ids, got {count}.",
                             "input_ids")


def check_sampling_parameters(text: str) -> None:
    if len(text) > MAX_SAMPLING_PARAMETERS_CHARS:
        raise ParameterError(f"sampling_parameters may have at most {MAX_SAMPLING_PARAMETERS_CHARS} "
                             f"characters, got {len(text)}.", "sampling_parameters")


def _integer(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit() and len(value) < 100:
        return int(value)
    return None


def _decoded(value: Any, opening: str) -> Any:
    """A list or object as given, or decoded from the JSON string that holds it."""
    if isinstance(value, str) and value.strip().startswith(opening):
        try:
            return json.loads(value)
        except ValueError:
            return None  # SamplingParams names it
    return value


def _count(sampling: Mapping[str, Any], name: str, limit: int, what: str) -> None:
    value = _decoded(sampling.get(name), "{" if name == "logit_bias" else "[")
    if isinstance(value, (list, dict)) and len(value) > limit:
        raise ParameterError(f"{name} may hold at most {limit} {what}, got {len(value)}.", name)


def _strings(values: Mapping[str, Any], key: str, limit: int, name: str | None = None) -> None:
    """values[key]: a string or a list of strings (`name`: the parameter's path, for the message)."""
    name = name or key
    value = _decoded(values.get(key), "[")
    items = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    if len(items) > limit:
        raise ParameterError(f"{name} may hold at most {limit} strings, got {len(items)}.", name.split(".")[0])
    for i, s in enumerate(items):
        if isinstance(s, str) and len(s) > MAX_STRING_CHARS:
            where = f"{name}[{i}]" if isinstance(value, list) else name
            raise ParameterError(f"{where} may have at most {MAX_STRING_CHARS} characters, got {len(s)}.",
                                 name.split(".")[0])
