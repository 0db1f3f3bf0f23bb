"""InputProcessor: validates and tokenizes a request before it reaches the engine."""
from __future__ import annotations

import json
import math
import os
import time
from typing import Callable

from ..engine_config import EngineConfig, EngineLimits
from ..errors import ParameterError
from ..lora_request import LoRARequest, lora_name_of
from ..core.block_manager import hash_prompt_blocks, root_block_hash
from .request import Request
from ..sampling_params import SamplingParams
from .structured_output import StructuredOutputManager


def load_eos_token_ids(model_dir: str, hf_config: dict, tokenizer) -> tuple[int, ...]:
    """EOS ids of config.json, generation_config.json and the tokenizer, together."""
    ids: set[int] = set()
    sources = [hf_config]
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path, encoding="utf-8") as f:
            sources.append(json.load(f))
    for source in sources:
        eos = source.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


class InputProcessor:
    """Turns (prompt, SamplingParams) into a Request, or raises ValueError with a message a
    client can act on. Reads only the tokenizer and fixed limits, so any thread may call it."""

    def __init__(self, config: EngineConfig, tokenizer, limits: EngineLimits,
                 check_structured_outputs: Callable[[dict], None] | None = None) -> None:
        """config: the engine's, resolved (max_model_len set). limits: what the built
        engine knows (vocabulary, KV capacity, EOS ids). check_structured_outputs: raises
        ValueError when a spec does not compile; by default it is compiled here (EngineProcess
        has the engine's process do it). The LoRA adapters a request may name are `lora_modules`;
        more may join (`lora_names` grows)."""
        model, cache, scheduler, lora = (config.model_config, config.cache_config, config.scheduler_config,
                                         config.lora_config)
        self.lora_names = tuple(lora.lora_modules) if lora else ()
        self.lora_enabled = lora is not None
        self.tokenizer = tokenizer
        self.tokenizer_path = model.tokenizer
        self._check_structured_outputs = check_structured_outputs
        self.scheduling_policy = scheduler.policy
        self.vocab_size = limits.vocab_size
        self.max_model_len = model.max_model_len
        self.kv_capacity_tokens = limits.kv_capacity_tokens
        self.max_num_seqs = scheduler.max_num_seqs
        self.max_logprobs = model.max_logprobs
        self.block_size = cache.block_size
        self.enable_prefix_caching = cache.enable_prefix_caching
        self.eos_token_ids = limits.eos_token_ids

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: tuple[int, ...]) -> None:
        self._eos_token_ids = tuple(ids)
        # Grammars end with EOS: they are compiled for these ids.
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self._eos_token_ids,
                                                  self.tokenizer_path)

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                arrival_time: float | None = None, priority: int = 0,
                lora_request: LoRARequest | str | None = None, deadline: float | None = None) -> Request:
        """deadline: wall-clock time (time.time()) by which the request must be done."""
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams.")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ParameterError(f"priority must be an integer, got {priority!r}.", "priority")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ParameterError(f"Got priority {priority}, but the engine's scheduling_policy is "
                                 f"{self.scheduling_policy!r}; priorities need scheduling_policy='priority'.",
                                 "priority")
        if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                     or not math.isfinite(deadline)):
            raise ValueError(f"deadline must be a finite time in seconds (time.time()), got {deadline!r}.")
        lora_name = self._check_lora(lora_name_of(lora_request))
        text: str | None = None
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("The prompt is empty.")
            text = prompt
            token_ids = list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            # The common case checked in C (types, then range); the slow scan only names the culprit.
            valid = (not token_ids or (set(map(type, token_ids)) == {int}
                                       and min(token_ids) >= 0 and max(token_ids) < self.vocab_size))
            bad = None if valid else next(
                (t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)
                 or not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"Token id {bad!r} is out of vocabulary "
                                 f"(valid ids are 0 to {self.vocab_size - 1}).")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}.")
        if not token_ids:
            raise ValueError("The prompt is empty.")
        keep = params.truncate_prompt_tokens
        if keep is not None:
            # Left truncation, as vLLM: the prompt's end is what the next token depends on most.
            keep = self.max_model_len - 1 if keep == -1 else keep
            if len(token_ids) > keep:
                token_ids = token_ids[-keep:]
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"The prompt has {n} tokens, but max_model_len is {self.max_model_len}: "
                             f"prompt plus at least one generated token must fit.")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            # vLLM's check (and message): the completion is not silently shortened.
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                             f"you requested {n + params.max_tokens} tokens ({n} in the prompt, "
                             f"{params.max_tokens} in the completion). Please reduce the length of the "
                             f"prompt or completion.")
        if n + 1 > self.kv_capacity_tokens:
            raise ValueError(f"The prompt has {n} tokens, more than the KV cache can ever hold "
                             f"({self.kv_capacity_tokens} tokens).")
        if params.n > self.max_num_seqs:
            raise ParameterError(f"n={params.n} is larger than max_num_seqs={self.max_num_seqs}.", "n")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ParameterError(f"{name}={value} is larger than max_logprobs={self.max_logprobs}.", name)
        params = params.clone()
        if params.bad_words:
            params.tokenize_bad_words(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        params.check_token_ids(self.vocab_size)
        if params.structured_outputs is not None:  # a bad regex, schema or grammar fails here
            try:
                (self._check_structured_outputs or self.structured.compile)(params.structured_outputs)
            except ValueError as e:  # its messages name structured_outputs
                raise ParameterError(str(e), "structured_outputs") from None
        params._eos_token_ids = self.eos_token_ids
        block_hashes = None
        if self.enable_prefix_caching:  # hashed here, on the caller's thread, not in the step loop
            block_hashes = hash_prompt_blocks(root_block_hash(lora_name, params.cache_salt), token_ids,
                                              self.block_size)
        return Request(request_id, text, token_ids, params, arrival_time or time.time(), priority,
                       lora_name, deadline, block_hashes)

    def _check_lora(self, name: str | None) -> str | None:
        if name is None:
            return None
        if not self.lora_enabled:
            raise ParameterError(f"lora_name {name!r}: this model serves no LoRA adapters "
                                 f"(start it with enable_lora and lora_modules).", "lora_name")
        if name not in self.lora_names:
            served = ", ".join(map(repr, self.lora_names)) or \
                "none yet (a LoRARequest with a lora_path adds one)"
            raise ParameterError(f"lora_name {name!r} is not an adapter of this model; it serves {served}.",
                                 "lora_name")
        return name
