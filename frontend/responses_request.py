"""The body of POST /v1/responses (OpenAI's Responses API) and its translation into a chat
completion request: `instructions` and the `input` items become chat messages, the flat function
tools chat tools, `text.format` a response_format. The chat path (template, tool-call and
reasoning parsers, structured outputs) then serves it unchanged, as vLLM serves it.

Nothing is stored: `store` is accepted and nothing is kept (vLLM's default), so that
`previous_response_id`, which would need a stored response, is refused; an agent sends the whole
conversation in `input` instead. What this server cannot honour is refused with a 400 naming the
field, rather than ignored."""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from tritium.frontend.errors import bad_request
from tritium.frontend.protocol import NON_TEXT_PARTS, ChatCompletionRequest, SamplingFields, _Body, parse_body
from tritium.frontend.refused_fields import CHAT_REFUSED

# The Responses API's fields this server does not implement, and their no-op values (see
# frontend/refused_fields.py); chat's refused vLLM extras too, and kv_transfer_params, which
# chat takes but a response has no place to return. Those that need more words are refused in
# _refuse_unsupported.
RESPONSES_REFUSED: dict[str, tuple[Any, ...]] = {
    **CHAT_REFUSED, "background": (None, False), "conversation": (None,), "prompt": (None,),
    "max_tool_calls": (None,), "top_logprobs": (None,), "context_management": (None, []),
    "kv_transfer_params": (None, {})}


class ResponsesRequest(_Body):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    # Accepted only as "not asked for" (see _refuse_unsupported).
    previous_response_id: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None

    refused_fields: ClassVar[dict[str, tuple]] = RESPONSES_REFUSED


# vLLM's extra sampling parameters, taken from the body as chat takes them; the fields the
# Responses API names itself (or has no use for: n) are left out.
_EXTRA_SAMPLING = tuple(f for f in SamplingFields.model_fields
                        if f not in {"model", "n", "max_tokens", "temperature", "top_p", "stream",
                                     "stream_options"})


def parse_responses_request(body: Any) -> tuple[ResponsesRequest, ChatCompletionRequest]:
    """The request, and the chat completion request that serves it; 400 for what it cannot."""
    req = parse_body(ResponsesRequest, body)
    _refuse_unsupported(req)
    chat: dict[str, Any] = {k: body[k] for k in _EXTRA_SAMPLING if body.get(k) is not None}
    chat.update(model=req.model, messages=chat_messages(req), stream=req.stream)
    given = {"temperature": req.temperature, "top_p": req.top_p,
             "max_completion_tokens": req.max_output_tokens, "tools": chat_tools(req.tools or []) or None,
             "tool_choice": chat_tool_choice(req.tool_choice), "response_format": response_format(req.text)}
    chat.update({k: v for k, v in given.items() if v is not None})
    return req, parse_body(ChatCompletionRequest, chat)


def _refuse_unsupported(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported: this server stores no responses "
                          "(store is accepted, and nothing is kept); send the whole conversation "
                          "in input", "previous_response_id")
    if req.include:
        raise bad_request(f"include: {', '.join(map(repr, req.include))} is not supported "
                          "(nothing can be included)", "include")
    if req.truncation == "auto":
        raise bad_request("truncation 'auto' is not supported: a prompt longer than the model "
                          "takes is refused", "truncation")
    if any(v is not None for v in (req.reasoning or {}).values()):
        raise bad_request("reasoning options are not supported: the server's --reasoning-parser "
                          "decides how the model's thinking is returned", "reasoning")


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` as the system message, then the input items as chat messages. A
    function_call joins the assistant message before it (one turn's text and calls are one
    message to a chat template); reasoning items are dropped, as chat drops earlier thinking."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    if not req.input:
        raise bad_request("input must not be empty", "input")
    for i, item in enumerate(req.input):
        where = f"input.{i}"
        kind = item.get("type", "message" if "role" in item else None)
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be one of user, system, developer, assistant, "
                                  f"got {role!r}", f"{where}.role")
            content = _text(item.get("content"), f"{where}.content")
            if role == "assistant" and last is not None and last.get("content") is None:
                last["content"] = content
            else:
                messages.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _text(item.get("output"), f"{where}.output")})
        elif kind != "reasoning":
            raise bad_request(f"{where}: input items of type {kind!r} are not supported (this server "
                              "takes messages, function_call, function_call_output and reasoning "
                              "items)", f"{where}.type")
    return messages


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string, got {value!r}"[:200], f"{where}.{key}")
    return value


def _text(content: Any, where: str) -> str:
    """A message's or a tool output's text: a string, or its text parts joined (as chat joins
    them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind in NON_TEXT_PARTS:
            raise bad_request(f"{where}.{j} is {NON_TEXT_PARTS[kind]} (type '{kind}'), and this model "
                              "takes text only", f"{where}.{j}")
        if kind not in ("input_text", "output_text", "text", "refusal") or not isinstance(part.get(key), str):
            raise bad_request(f"{where}.{j} must be a text part, {{\"type\": \"input_text\", \"text\": "
                              f"\"...\"}}, got {str(part)[:80]}", f"{where}.{j}")
        texts.append(part[key])
    return "\n".join(texts)


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Responses API's flat function tools in chat's shape; any other tool type is refused:
    this server runs no tools of its own (web_search, file_search, ...), the client runs them."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(f"tools.{i}: tools of type {kind!r} are not supported: this server "
                              "serves function tools only", f"tools.{i}.type")
        _string(tool, "name", f"tools.{i}")
        out.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": _string(choice, "name", "tool_choice")}}
    raise bad_request(f"tool_choice of type {choice.get('type')!r} is not supported (give none, auto, "
                      "required or {\"type\": \"function\", \"name\": ...})", "tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (guided decoding, as chat serves it)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise bad_request(f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                          "text.format.type")
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request("text.format json_schema needs a schema (an object)", "text.format.schema")
    return {"type": "json_schema", "json_schema": {
        k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}}
