"""Sampling parameters with vLLM's names and meanings, validated on construction."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from .errors import ParameterError
from .structured_output_spec import check_spec

# Larger requests for top logprobs are rejected: every one costs a sort over the vocabulary.
MAX_LOGPROBS = 20
# The sampler works on float32 logits: biases, penalties and temperatures are bounded so that no
# step of it overflows (an inf or NaN logit makes the whole row NaN, and the sample token 0).
# With |bias| <= 1e10, repetition_penalty >= 1e-4 and a temperature >= 1e-5 (smaller is greedy,
# which divides by nothing), a logit stays below about 1e19, far inside float32.
FLOAT32_MAX = 3.4028234663852886e38
MAX_LOGIT_BIAS = 1e10
MIN_REPETITION_PENALTY = 1e-4
# vLLM's range for seed (torch's int64): a larger one would be cut to 64 bits, silently.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
                 "top_p", "min_p")


@dataclass
class SamplingParams:
    """How to sample one request. `temperature == 0` means greedy.

    Raises ValueError naming the offending parameter when a value is out of range.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None
    # Logprobs of the prompt's tokens (each given the ones before it), with this many of the
    # most likely alternatives per position (vLLM's prompt_logprobs). Such a prompt is always
    # computed in full: a prefix-cache hit would skip the positions whose logprobs are asked.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Added to the logits of these token ids before penalties and sampling (vLLM's logit_bias;
    # JSON's string keys, as the OpenAI API sends them, are read as token ids).
    logit_bias: dict[int, float] | None = None
    # Only these token ids can be sampled (vLLM's allowed_token_ids).
    allowed_token_ids: list[int] | None = None
    # Keep only the prompt's last k tokens (left truncation); -1: as many as max_model_len
    # leaves room for (all but one).
    truncate_prompt_tokens: int | None = None
    # Words never to generate (vLLM's bad_words): each word's last token is banned whenever the
    # output so far ends with the word's other tokens. Tokenized by the engine, with and without
    # a leading space, as vLLM does (`bad_words_token_ids`).
    bad_words: list[str] | None = None
    # The output follows a JSON schema, any JSON object, a regex, one of some strings or an EBNF
    # grammar: exactly one of {"json", "json_object", "regex", "choice", "grammar"}, plus
    # "disable_any_whitespace" (vLLM's StructuredOutputsParams as a dict; `from_dict` also
    # takes it under its older name, guided_decoding). See backend/engine/structured_output.py.
    structured_outputs: dict[str, Any] | None = None
    # Prefix-cache isolation (vLLM's cache_salt): requests share cached KV blocks only when their
    # salts are equal (or both absent); a tenant's own salt keeps others from probing its prompts.
    cache_salt: str | None = None
    # vLLM's free-form extras; its "kv_transfer_params" steers disaggregated prefill
    # (backend/kv_transfer/connector.py): {"do_remote_decode": true} on a producer, the
    # producer's returned parameters on a consumer.
    extra_args: dict[str, Any] | None = None
    # Filled by the engine from the tokenizer / generation config, not by users.
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False)
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ParameterError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}.",
                                     "logit_bias")
            self.logit_bias = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        elif self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if self.top_k == -1:
            self.top_k = 0
        if self.structured_outputs is not None:
            try:
                self.structured_outputs = check_spec(self.structured_outputs)
            except ValueError as e:  # its messages name structured_outputs
                raise ParameterError(str(e), "structured_outputs") from None
        self._verify()

    def _verify(self) -> None:
        _check_type("n", self.n, int)
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _check_type(name, value, (int, float))
            if not math.isfinite(value):
                raise ParameterError(f"{name} must be a finite number, got {value}.", name)
        _check_type("top_k", self.top_k, int)
        _check_type("min_tokens", self.min_tokens, int)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            _check_type(name, getattr(self, name), bool)
        if self.max_tokens is not None:
            _check_type("max_tokens", self.max_tokens, int)
        if self.seed is not None:
            _check_type("seed", self.seed, int)
            if not SEED_MIN <= self.seed <= SEED_MAX:
                raise ParameterError(f"seed must be a 64-bit signed integer, in [{SEED_MIN}, {SEED_MAX}], "
                                     f"got {self.seed}.", "seed")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_type(name, getattr(self, name), int)
        if self.truncate_prompt_tokens is not None:
            _check_type("truncate_prompt_tokens", self.truncate_prompt_tokens, int)
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ParameterError(f"truncate_prompt_tokens must be -1 or at least 1, "
                                     f"got {self.truncate_prompt_tokens}.", "truncate_prompt_tokens")
        if self.n < 1:
            raise ParameterError(f"n must be at least 1, got {self.n}.", "n")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ParameterError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.",
                                 "presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ParameterError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.",
                                 "frequency_penalty")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ParameterError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.",
                                 "repetition_penalty")
        if self.repetition_penalty < MIN_REPETITION_PENALTY:
            raise ParameterError(f"repetition_penalty must be at least {MIN_REPETITION_PENALTY:g} (smaller "
                                 f"values overflow the sampler's float32 logits), got {self.repetition_penalty}.",
                                 "repetition_penalty")
        if self.temperature < 0.0:
            raise ParameterError(f"temperature must be non-negative, got {self.temperature}.", "temperature")
        if self.temperature > FLOAT32_MAX:
            raise ParameterError(f"temperature must be at most {FLOAT32_MAX:.4g} (the sampler's float32), "
                                 f"got {self.temperature}.", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise ParameterError(f"top_p must be in (0, 1], got {self.top_p}.", "top_p")
        if self.top_k < 0:
            raise ParameterError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise ParameterError(f"min_p must be in [0, 1], got {self.min_p}.", "min_p")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ParameterError(f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens")
        if self.min_tokens < 0:
            raise ParameterError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.",
                                 "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParameterError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                                 f"got {self.min_tokens}.", "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ParameterError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}.", name)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ParameterError(f"stop must contain only non-empty strings, got {s!r}.", "stop")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ParameterError(f"stop_token_ids must contain only non-negative integers, got {t!r}.",
                                     "stop_token_ids")
        for t, bias in (self.logit_bias or {}).items():
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ParameterError(f"logit_bias keys must be non-negative token ids, got {t!r}.",
                                     "logit_bias")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                raise ParameterError(f"logit_bias values must be finite numbers, got {bias!r} for token {t}.",
                                     "logit_bias")
            if abs(bias) > MAX_LOGIT_BIAS:
                raise ParameterError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] "
                                     f"(the sampler adds them to float32 logits), got {bias!r} for token {t}.",
                                     "logit_bias")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ParameterError(f"extra_args must be an object, got {type(self.extra_args).__name__}.", "extra_args")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ParameterError(f"cache_salt must be a non-empty string if provided, got {self.cache_salt!r}.",
                                 "cache_salt")
        for w in self.bad_words or ():
            if not isinstance(w, str) or not w.strip():
                raise ParameterError(f"bad_words must contain only non-empty strings, got {w!r}.",
                                     "bad_words")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ParameterError("allowed_token_ids must not be empty.", "allowed_token_ids")
            for t in self.allowed_token_ids:
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ParameterError(f"allowed_token_ids must contain only non-negative integers, got {t!r}.",
                                         "allowed_token_ids")
        if self.structured_outputs is not None:
            # The output ends where the grammar does, with EOS: both would keep it going.
            if self.ignore_eos:
                raise ParameterError("structured_outputs cannot be combined with ignore_eos: the output "
                                     "ends with EOS where the grammar is complete.", "structured_outputs")
            if self.min_tokens:
                raise ParameterError("structured_outputs cannot be combined with min_tokens: the output "
                                     "ends with EOS where the grammar is complete.", "structured_outputs")

    def tokenize_bad_words(self, encode) -> None:
        """Token ids of each bad word, as vLLM makes them: the word as given (without leading
        spaces), and with one leading space when that is another tokenization of the same
        length (the word in the middle of a text). `encode(text)` gives ids without special
        tokens."""
        words: list[list[int]] = []
        for word in self.bad_words or ():
            plain = list(encode(word.lstrip()))
            if not plain:  # nothing the tokenizer keeps: no token to ban
                continue
            words.append(plain)
            spaced = list(encode(" " + word.lstrip()))
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                words.append(spaced)
        self._bad_words_token_ids = words

    @property
    def has_penalties(self) -> bool:
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty)

    @property
    def needs_output_on_host(self) -> bool:
        """Whether sampling reads this sequence's previous tokens on the host (bad words of
        several tokens, a grammar), so that the engine defers the sampling of a step it launches
        before taking the previous step's tokens. Penalties do not: their counts are kept on the
        device (backend/layers/penalties.py)."""
        return bool(any(len(w) > 1 for w in self._bad_words_token_ids)
                    or self.structured_outputs is not None)

    def check_token_ids(self, vocab_size: int) -> None:
        """Token ids of logit_bias, allowed_token_ids and the bad words must be in the
        vocabulary."""
        bad_words = [t for w in self._bad_words_token_ids for t in w]
        for name, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("bad_words", bad_words)):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise ParameterError(f"{name}: token id {bad} is out of vocabulary "
                                     f"(valid ids are 0 to {vocab_size - 1}).", name)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        """stop_token_ids plus the EOS ids unless ignore_eos; computed once (checked per token)."""
        cached = self.__dict__.get("_stop_set")
        if cached is None or cached[0] != self._eos_token_ids:
            ids = set(self.stop_token_ids)
            if not self.ignore_eos:
                ids.update(self._eos_token_ids)
            cached = (self._eos_token_ids, frozenset(ids))
            self.__dict__["_stop_set"] = cached
        return cached[1]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Build from a JSON-like dict, as servers receive it.

        Values may be native JSON types or strings ("256", "0.7", "true", '["a"]'), since load
        generators such as genai-perf send every value as a string. Unknown keys are rejected.
        """
        if not isinstance(values, dict):
            raise ValueError(f"sampling parameters must be a JSON object, got {type(values).__name__}.")
        kwargs: dict[str, Any] = {}
        if "guided_decoding" in values and "structured_outputs" in values:
            raise ParameterError("Give structured_outputs or guided_decoding (its older name), not both.",
                                 "structured_outputs")
        for key, value in values.items():
            # guided_decoding: vLLM's older name, which Triton's vLLM backend also takes
            name = "structured_outputs" if key == "guided_decoding" else key
            if name not in _PUBLIC_FIELDS:
                raise ParameterError(f"Unknown sampling parameter '{key}'. "
                                     f"Valid parameters: {', '.join(sorted(_PUBLIC_FIELDS))}.", key)
            kwargs[name] = _coerce(key, value, _PUBLIC_FIELDS[name])
        return cls(**kwargs)

    def clone(self) -> "SamplingParams":
        clone = dataclasses.replace(self)
        clone.__dict__.pop("_stop_set", None)
        return clone


_INT, _FLOAT, _BOOL = "int", "float", "bool"
_PUBLIC_FIELDS: dict[str, str] = {
    "n": _INT, "presence_penalty": _FLOAT, "frequency_penalty": _FLOAT,
    "repetition_penalty": _FLOAT, "temperature": _FLOAT, "top_p": _FLOAT, "top_k": _INT,
    "min_p": _FLOAT, "seed": "int?", "stop": "str_list", "stop_token_ids": "int_list",
    "ignore_eos": _BOOL, "max_tokens": "int?", "min_tokens": _INT, "logprobs": "int?", "prompt_logprobs": "int?",
    "skip_special_tokens": _BOOL, "spaces_between_special_tokens": _BOOL,
    "include_stop_str_in_output": _BOOL, "logit_bias": "float_dict?", "allowed_token_ids": "int_list?",
    "truncate_prompt_tokens": "int?", "bad_words": "str_list?", "structured_outputs": "object?",
    "cache_salt": "str?",
}


def _check_type(name: str, value: Any, types: type | tuple[type, ...]) -> None:
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ParameterError(f"{name} must be a number, got {value!r}.", name)
    if not isinstance(value, types):
        raise ParameterError(f"{name} must be of type "
                             f"{getattr(types, '__name__', 'number')}, got {value!r}.", name)


def _coerce(key: str, value: Any, kind: str) -> Any:
    """Turn a JSON value (possibly a string) into the field's type, or raise a clear error."""
    if kind.endswith("?"):
        if value is None:
            return None
        kind = kind[:-1]
    try:
        if kind == _BOOL:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
            raise ValueError
        if kind == _INT:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, int):
                return value
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, str):
                return int(value.strip())
            raise ValueError
        if kind == _FLOAT:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, (int, float)):
                return float(value)
            if isinstance(value, str):
                return float(value.strip())
            raise ValueError
        if kind == "str":
            if isinstance(value, str):
                return value
            raise ValueError
        if kind == "object":  # a JSON object, or a string holding one
            if isinstance(value, str):
                value = json.loads(value)
            if isinstance(value, dict):
                return value
            raise ValueError
        if kind == "float_dict":  # {token id: bias}; JSON object keys are strings
            if isinstance(value, str):
                value = json.loads(value)
            if isinstance(value, dict):
                return {_coerce(key, k, _INT): _coerce(key, v, _FLOAT) for k, v in value.items()}
            raise ValueError
        if kind in ("str_list", "int_list"):
            if isinstance(value, str) and kind == "int_list" or (
                    isinstance(value, str) and value.strip().startswith("[")):
                value = json.loads(value)
            if kind == "str_list":
                if isinstance(value, str):
                    return [value]
                if isinstance(value, list) and all(isinstance(v, str) for v in value):
                    return value
                raise ValueError
            if isinstance(value, int) and not isinstance(value, bool):
                return [value]
            if isinstance(value, list):
                return [_coerce(key, v, _INT) for v in value]
            raise ValueError
    except (ValueError, TypeError, json.JSONDecodeError):
        pass
    expected = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
                "str_list": "a string or a list of strings",
                "int_list": "an integer or a list of integers",
                "float_dict": "an object of token ids to numbers", "object": "a JSON object"}[kind]
    raise ParameterError(f"sampling parameter '{key}' must be {expected}, got {value!r}.", key)
