"""What the frontend knows about each served model: whether it takes token ids, and its
tokenizer and chat template, found from the model's own config (its `tokenizer` or `model`
parameter), so nothing is configured twice."""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from tritium.frontend.errors import OpenAIError
from tritium.frontend.triton_gateway import TritonGateway

logger = logging.getLogger(__name__)



def _model_root() -> str:
    """Where a relative `model` path in a config.pbtxt starts, as the backend's model.py takes it:
    $TRITIUM_ROOT (the checkout, the container's /opt/tritium), else the working directory."""
    return os.environ.get("TRITIUM_ROOT") or os.getcwd()


@dataclass
class ServedModel:
    """One ready Triton model, with its tokenizer (loaded on first use)."""

    name: str
    takes_input_ids: bool
    tokenizer_path: str | None
    chat_template: str | None = None  # --chat-template overrides the tokenizer's
    reports_cached_tokens: bool = False  # has the return_num_cached_tokens input (Tritium's)
    # OpenAI's system_fingerprint: the backend configuration the model runs with (here a digest
    # of its Triton config: engine arguments, model path, inputs), which changes when that does.
    system_fingerprint: str | None = None
    max_model_len: int | None = None  # the engine's (see describe), else its Triton config's, if any
    reports_stop_reason: bool = False  # has the return_stop_reason input (Tritium's)
    # From a Tritium model's own description (its MODEL_INFO answer; see describe): the model's
    # path (vLLM's `root` in /v1/models) and its LoRA adapters, name -> directory.
    root: str | None = None
    lora_modules: dict[str, str] = field(default_factory=dict)
    _tokenizer: Any = field(default=None, repr=False)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            if self.tokenizer_path is None:
                raise OpenAIError(400, f"model '{self.name}' names no tokenizer in its config "
                                  "(a 'tokenizer' or 'model' parameter): start the frontend "
                                  "with --tokenizer DIR")
            # The engine's loader: it falls back to tokenizer.json where transformers'
            # AutoTokenizer cannot be imported (its optional dependencies built for another NumPy).
            from tritium.engine.tokenizer import load_tokenizer
            self._tokenizer = load_tokenizer(self.tokenizer_path)
        return self._tokenizer

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict] | None,
                            add_generation_prompt: bool, continue_final_message: bool,
                            kwargs: dict[str, Any]) -> str:
        tok = self.tokenizer
        template = self.chat_template or getattr(tok, "chat_template", None)
        if not template:
            raise OpenAIError(400, f"model '{self.name}' has no chat template (none in its "
                              "tokenizer files): start the frontend with --chat-template FILE, "
                              "or use /v1/completions")
        try:
            return tok.apply_chat_template(messages, tools=tools, chat_template=template,
                                           add_generation_prompt=add_generation_prompt and not continue_final_message,
                                           continue_final_message=continue_final_message,
                                           tokenize=False, **kwargs)
        except Exception as e:  # noqa: BLE001 - a template error is about this request's messages
            raise OpenAIError(400, f"the chat template failed on these messages: {e}") from None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def model_not_found(name: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")  # vLLM's words


@dataclass(frozen=True)
class Target:
    """What a request's `model` names: a Triton model, maybe with one of its LoRA adapters, and
    the name its responses report (vLLM's: the first served name, or the adapter's)."""

    model: ServedModel
    name: str
    lora_name: str | None = None

    def with_lora(self, sampling: dict[str, Any]) -> dict[str, Any]:
        """The sampling parameters with the adapter the name selects, as `lora_name` selects it."""
        if self.lora_name is None:
            return sampling
        given = sampling.get("lora_name")
        if given is not None and given != self.lora_name:
            raise OpenAIError(400, f"model names the LoRA adapter '{self.lora_name}' and lora_name "
                              f"names '{given}': give one", "lora_name")
        return {**sampling, "lora_name": self.lora_name}


class ModelRegistry:
    """The models this frontend serves: those ready in Triton (or the --model names only), each
    under its Triton name or the --served-model-name names, and their LoRA adapters."""

    def __init__(self, gateway: TritonGateway, names: list[str] | None = None,
                 tokenizer: str | None = None, chat_template: str | None = None,
                 served_model_names: list[str] | None = None) -> None:
        self.gateway = gateway
        self.names = names or None
        # vLLM's --served-model-name: the names of the one Triton model in `names`.
        self.served_model_names = list(served_model_names or ())
        if self.served_model_names and (self.names is None or len(self.names) != 1):
            raise ValueError("--served-model-name names one Triton model: give it with --model")
        self.tokenizer_override = tokenizer
        self.chat_template = chat_template
        self._models: dict[str, ServedModel] = {}
        self._lock = asyncio.Lock()

    async def ready_models(self) -> list[str]:
        index = await self.gateway.repository_index()
        ready = [m["name"] for m in index if m.get("state") == "READY"]
        return [m for m in ready if self.names is None or m in self.names]

    async def get(self, name: str) -> ServedModel:
        """The model, or 404 when Triton does not have it, or 503 when it is not ready."""
        model = self._models.get(name)
        if model is not None:
            return model
        async with self._lock:
            if name in self._models:
                return self._models[name]
            index = {m["name"]: m for m in await self.gateway.repository_index()}
            if name not in index or (self.names is not None and name not in self.names):
                raise model_not_found(name)
            if index[name].get("state") != "READY":
                raise OpenAIError(503, f"The model '{name}' is not ready "
                                  f"(Triton reports {index[name].get('state') or 'no state'}).")
            config = await self.gateway.model_config(name)
            inputs = {i["name"] for i in config.get("input", [])}
            model = ServedModel(name, "input_ids" in inputs,
                                self.tokenizer_override or _tokenizer_path(config), self.chat_template,
                                "return_num_cached_tokens" in inputs, _fingerprint(config),
                                _max_model_len(config), reports_stop_reason="return_stop_reason" in inputs)
            if model.tokenizer_path is not None:
                await asyncio.to_thread(lambda: model.tokenizer)  # off the event loop, once
            model.root = _config_string(config, "model")
            await self.describe(model)
            self._models[name] = model
            return model

    async def describe(self, model: ServedModel) -> None:
        """Ask a Tritium model for its path, max_model_len (the engine's, resolved against the
        model's config.json) and LoRA adapters; asked again at each /v1/models and before a
        request's unknown name is refused, as a reload can change the adapters. A model that
        does not take the request (Triton's vLLM backend) keeps what its config says."""
        if not model.reports_cached_tokens:  # not Tritium's: it would take the request for a prompt
            return
        try:
            info = await self.gateway.model_info(model.name)
        except OpenAIError as e:
            logger.warning("model %s: its max_model_len and LoRA adapters are not known (%s)", model.name, e.message)
            return
        model.root, model.max_model_len = info.get("model"), info.get("max_model_len")
        model.lora_modules = dict(info.get("lora_modules") or {})

    def public_names(self, triton_name: str) -> list[str]:
        """The names a Triton model is served under, the one responses report first."""
        return self.served_model_names or [triton_name]

    async def resolve(self, name: str) -> Target:
        """The model a request's `model` names: a served model, or a LoRA adapter of one (vLLM's
        way to select it). 404 in vLLM's words for any other name, 503 for a model not ready."""
        if self.served_model_names:
            if name in self.served_model_names:
                return Target(await self.get(self.names[0]), self.served_model_names[0])
        elif name in self._models:
            return Target(self._models[name], name)
        target = self._adapter(name)
        if target is not None:
            return target
        if not self.served_model_names:
            try:
                return Target(await self.get(name), name)
            except OpenAIError as e:
                if e.status != 404:
                    raise
        for triton_name in await self.ready_models():  # an adapter added at a reload?
            try:
                await self.describe(await self.get(triton_name))
            except OpenAIError:
                pass  # (unloaded meanwhile)
        target = self._adapter(name)
        if target is None:
            raise model_not_found(name)
        return target

    def _adapter(self, name: str) -> Target | None:
        for model in list(self._models.values()):
            if name in model.lora_modules:
                return Target(model, name, name)
        return None

    async def warm(self) -> None:
        """Look up the served models and load their tokenizers now (at start-up, before the
        process takes connections). Best effort: a model not ready yet is left to its first
        request."""
        try:
            names = await self.ready_models()
        except OpenAIError as e:
            logger.warning("frontend start-up: no models looked up (%s)", e.message)
            return
        for name in names:
            try:
                await self.get(name)
            except Exception as e:  # noqa: BLE001 - the first request will say what is wrong
                logger.warning("frontend start-up: model %s not prepared (%s)", name, e)

    def forget(self, name: str) -> None:
        """Drop what is known of a model (it was unloaded or reloaded)."""
        self._models.pop(name, None)


def _fingerprint(config: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode("utf-8")).hexdigest()
    return f"fp_{digest[:12]}"


def _max_model_len(config: dict[str, Any]) -> int | None:
    value = config.get("parameters", {}).get("max_model_len", {}).get("string_value", "")
    return int(value) if value.strip().isdigit() and int(value) > 0 else None


def _config_string(config: dict[str, Any], key: str) -> str | None:
    return config.get("parameters", {}).get(key, {}).get("string_value") or None


def _tokenizer_path(config: dict[str, Any]) -> str | None:
    params = config.get("parameters", {})
    for key in ("tokenizer", "model"):
        value = params.get(key, {}).get("string_value")
        if value:
            local = value if os.path.isabs(value) else os.path.join(_model_root(), value)
            # Otherwise a Hub name (org/model), or a path from the current directory.
            return local if os.path.exists(local) else value
    return None
