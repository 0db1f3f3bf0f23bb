"""Tool calling through the `openai` client, against tritonserver and the frontend serving tiny
Llamas trained on one tool-using conversation (scripts/build_tool_model.py): the agent loop
(tool call, tool result, final answer) with tool_choice "auto", streamed and not, with the
hermes parser (and the qwen3 reasoning parser taking out the thinking) and with llama3_json;
a reply without a call stays text."""
import json

import pytest
from openai import OpenAI

from scripts import tool_chat_formats as tm


@pytest.fixture(scope="module")
def stack(tool_stack):
    """tests/conftest.py's tool_stack (shared with tests/test_frontend_responses.py)."""
    return tool_stack


@pytest.fixture(scope="module")
def client(stack):
    return OpenAI(api_key="none", base_url=stack[1].url + "/v1", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llama_client(stack):
    return OpenAI(api_key="none", base_url=stack[2].url + "/v1", max_retries=0, timeout=120)


def ask(client, messages, model="llm", **kw):
    return client.chat.completions.create(model=model, messages=messages, tools=tm.TOOLS,
                                          temperature=0, max_tokens=64, **kw)


def test_agent_loop(client):
    r = ask(client, tm.QUESTION, tool_choice="auto")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')

    # The agent runs the tool and sends back the assistant's message and the result.
    result = {"role": "tool", "tool_call_id": call.id, "content": tm.TOOL_RESULT}
    history = tm.QUESTION + [choice.message.model_dump(exclude_none=True), result]
    r = ask(client, history)  # tools without tool_choice: "auto"
    choice = r.choices[0]
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == \
        ("stop", tm.ANSWER, None)
    assert choice.message.model_extra["reasoning_content"] == tm.REASONING


def test_agent_loop_streamed(client):
    """The openai package's stream helper accumulates the tool-call deltas into the same call."""
    with client.chat.completions.stream(model="llm", messages=tm.QUESTION, tools=tm.TOOLS,
                                        tool_choice="auto", temperature=0, max_tokens=64) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    deltas = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []]
    # The first delta opens the call (index, id, type, name); the arguments follow in pieces.
    assert (deltas[0].index, deltas[0].id, deltas[0].type, deltas[0].function.name) == \
        (0, call.id, "function", "get_weather")
    assert all(d.id is None and d.function.name is None and d.index == 0 for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == '{"city": "Paris"}'
    assert not any(ch.delta.content for c in chunks for ch in c.choices)

    history = tm.QUESTION + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": tm.TOOL_RESULT}]
    content, reasoning, reasons = "", "", []
    for chunk in ask(client, history, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            assert not ch.delta.tool_calls
            reasons += [ch.finish_reason] if ch.finish_reason else []
    assert (content, reasoning, reasons) == (tm.ANSWER, tm.REASONING, ["stop"])


def test_a_reply_without_a_call_stays_text(client):
    r = ask(client, tm.GREETING, tool_choice="auto")
    choice = r.choices[0]
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == \
        ("stop", tm.GREETING_REPLY, None)
    assert choice.message.model_extra["reasoning_content"] is None
    streamed = "".join(ch.delta.content or "" for c in ask(client, tm.GREETING, stream=True)
                       for ch in c.choices)
    assert streamed == tm.GREETING_REPLY


def test_tool_choice_required_and_none(client):
    """"required" makes the model write a call array (guided decoding): its first call names a
    given function with arguments that follow its schema, streamed or not."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"]}}}]
    kw = dict(model="llm", messages=tm.QUESTION, tools=tools, tool_choice="required", temperature=0,
              max_tokens=48, extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    r = client.chat.completions.create(**kw)
    first = r.choices[0].message.tool_calls[0]
    assert first.function.name == "get_weather"
    assert first.function.arguments in ('{"unit": "C"}', '{"unit": "F"}')  # xgrammar's separators
    assert r.choices[0].finish_reason in ("tool_calls", "length")
    arguments = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            arguments[tc.index] = arguments.get(tc.index, "") + (tc.function.arguments or "")
    assert arguments[0] == first.function.arguments

    r = ask(client, tm.QUESTION, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_agent_loop_llama3_json(llama_client):
    """Llama 3.1's format: the whole reply is the call's JSON; streamed and not."""
    r = ask(llama_client, tm.QUESTION, model="llama", tool_choice="auto")
    choice = r.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    with llama_client.chat.completions.stream(model="llama", messages=tm.QUESTION, tools=tm.TOOLS,
                                              temperature=0, max_tokens=64) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [("get_weather", '{"city": "Paris"}')]

    history = tm.QUESTION + [choice.message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": call.id, "content": tm.TOOL_RESULT}]
    r = ask(llama_client, history, model="llama")
    assert (r.choices[0].finish_reason, r.choices[0].message.content, r.choices[0].message.tool_calls) == \
        ("stop", tm.ANSWER, None)
    r = ask(llama_client, tm.GREETING, model="llama")
    assert (r.choices[0].finish_reason, r.choices[0].message.content) == ("stop", tm.GREETING_REPLY)
