"""The request bodies of /v1/chat/completions and /v1/completions (OpenAI's fields, plus vLLM's
extra sampling parameters). Types are checked here; ranges are the engine's to check, so that
its messages reach the client unchanged; sizes (n, list lengths, prompt lengths) are bounded
here first (frontend/limits.py), before anything is built from them."""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tritium.frontend.errors import OpenAIError, bad_request
from tritium.frontend.limits import check_collection_sizes, check_values
from tritium.frontend.refused_fields import CHAT_REFUSED, COMPLETION_REFUSED, refuse_unsupported


class _Body(BaseModel):
    # Fields this server does not use (user, metadata, store, ...) are accepted and ignored, as
    # OpenAI clients send them freely.
    # NaN and infinity: Python's JSON parser takes them, the JSON standard (and OpenAI) does not.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk

    @property
    def continuous(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class SamplingFields(_Body):
    """Fields shared by chat and completions: OpenAI's, then vLLM's extra parameters."""

    model: str
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    priority: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None  # vLLM's: prefix-cache isolation between tenants
    best_of: int | None = None  # only equal to n: no more candidates are sampled than returned
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs (not streamed)
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs' tokens as "token_id:123"
    request_id: str | None = None  # vLLM's: the response id is "chatcmpl-" / "cmpl-" and this
    truncation_side: Literal["left", "right"] | None = None  # the engine keeps the last tokens
    guided_decoding_backend: str | None = None
    # vLLM's disaggregated prefill: what a proxy sends each instance, forwarded to the engine.
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("n")
    @classmethod
    def _n_positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"n must be at least 1, got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (v or {}).items():
            if not -100 <= bias <= 100:  # OpenAI's range
                raise ValueError(f"the bias of token {token} must be in [-100, 100], got {bias}")
        return v


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        # Before the union's own check, whose first complaint would be "not a string".
        for i, part in enumerate(v if isinstance(v, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in NON_TEXT_PARTS:
                raise ValueError(f"part {i} is {NON_TEXT_PARTS[kind]} (type '{kind}'), and this "
                                 "model takes text only: send text parts or a string")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"part {i} must be a text part, {{\"type\": \"text\", \"text\": "
                                 f"\"...\"}}, got {str(part)[:80]}")
        return v


# OpenAI's (and vLLM's) content part types that carry something other than text.
NON_TEXT_PARTS = {"image_url": "an image", "input_image": "an image", "image": "an image",
                  "input_audio": "audio", "audio_url": "audio", "video_url": "a video",
                  "file": "a file", "input_file": "a file"}


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's
    echo: bool = False  # the reply starts with the last message's content, when roles match
    include_reasoning: bool = True
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    documents: list[dict[str, str]] | None = None  # for the chat template (RAG)
    add_special_tokens: bool = False  # on top of the template's
    refused_fields: ClassVar[dict[str, tuple]] = CHAT_REFUSED

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must not be empty")
        return v


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS before a text prompt
    response_format: ResponseFormat | None = None  # vLLM's, as chat's
    refused_fields: ClassVar[dict[str, tuple]] = COMPLETION_REFUSED


def parse_body(cls: type[_Body], body: Any) -> Any:
    """Validate a decoded JSON body; a failure is a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    refuse_unsupported(body, getattr(cls, "refused_fields", {}))
    check_collection_sizes(body)  # before validation builds an object per item
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        raise _first_error(e) from None
    check_values(req)  # before anything is built per choice
    return req


def _first_error(e: ValidationError) -> OpenAIError:
    err = e.errors(include_url=False)[0]
    # Union members add their type names to the location; keep the field path only.
    loc = [str(p) for p in err["loc"] if isinstance(p, int) or not _is_type_tag(str(p))]
    param = ".".join(loc) or None
    message = err["msg"].removeprefix("Value error, ")
    return bad_request(f"{param}: {message}" if param else message, param)


def _is_type_tag(part: str) -> bool:
    return (part in {"str", "int", "float", "bool", "list[str]", "list[int]", "list[list[int]]",
                     "dict[str,any]", "function-after[_not_empty(), list[ChatMessage]]"}
            or part.startswith(("list[", "dict[", "literal[", "function-", "NamedToolChoice")))
