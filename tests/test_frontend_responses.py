"""POST /v1/responses (OpenAI's Responses API) through the `openai` client and the OpenAI Agents
SDK, against the frontend serving the tiny Hermes-format tool model (tests/conftest.py's
tool_stack, shared with tests/test_frontend_tools.py). Greedy: each reply must equal, item for
item, what /v1/chat/completions gives for the same conversation."""
import asyncio
import json

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tritium.frontend.chat_output import ChatParsing
from tritium.frontend.responses import _Reply
from tritium.frontend.responses_request import parse_responses_request
from tritium.frontend.serving import TokenCounts
from tritium.frontend.triton_gateway import Chunk
from scripts import tool_chat_formats as tm

# tm.TOOLS in the Responses API's flat shape.
TOOLS = [{"type": "function", **tm.TOOLS[0]["function"]}]
INSTRUCTIONS = tm.SYSTEM["content"]
QUESTION = tm.QUESTION[1]["content"]
# vLLM's structured-outputs option (an extra field on both endpoints): no free whitespace.
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


@pytest.fixture(scope="module")
def client(tool_stack):
    return OpenAI(api_key="none", base_url=tool_stack[1].url + "/v1", max_retries=0, timeout=120)


def respond(client, input, **kw):
    return client.responses.create(model="llm", instructions=INSTRUCTIONS, input=input, temperature=0,
                                   **{"max_output_tokens": 64, **kw})


def chat(client, messages, **kw):
    return client.chat.completions.create(model="llm", messages=messages, temperature=0, **{"max_tokens": 64, **kw})


def items(output):
    """Output items without their random ids (nor the field the stream helper adds)."""
    return [{k: v for k, v in item.to_dict().items() if k not in ("id", "call_id", "parsed_arguments")}
            for item in output]


def after_call(call):
    """The agent's next input: the question, the model's call, the tool's result."""
    return [{"role": "user", "content": QUESTION}, call.to_dict(),
            {"type": "function_call_output", "call_id": call.call_id, "output": tm.TOOL_RESULT}]


def run_reply(body, pieces, reason="stop"):
    """In-process: the response object for the model text `pieces` (the hermes and qwen3
    parsers, as the tool frontend runs them), and the events when they are streamed."""
    req, chat_req = parse_responses_request(body)
    outputs = ChatParsing("hermes", True, "qwen3").for_request(chat_req, "")
    whole = _Reply(req, "resp_1", outputs(), "llm").complete("".join(pieces), reason, TokenCounts(5, len(pieces)))
    chunks = [Chunk([p], [1], [reason if i == len(pieces) - 1 else None], 5) for i, p in enumerate(pieces)]

    async def rest():
        for chunk in chunks[1:]:
            yield chunk

    async def stream():
        return [json.loads(e.split("data: ", 1)[1]) async for e in
                _Reply(req, "resp_1", outputs(), "llm").events(chunks[0], rest())]
    return whole, asyncio.run(stream())


def test_streamed_and_whole_replies_agree():
    """However the text is cut, the stream's items are the non-streamed reply's, in the same order."""
    text = f"<think>{tm.REASONING}</think>\nSure.\n<tool_call>\n" + \
        json.dumps({"name": "get_weather", "arguments": tm.CALL_ARGUMENTS}) + "\n</tool_call>"
    body = {"model": "llm", "input": QUESTION, "tools": TOOLS}
    whole, events = run_reply(body, list(text))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert items_of(done) == items_of(events[-1]["response"]["output"]) == items_of(whole["output"]) == [
        {"type": "reasoning", "status": "completed", "summary": [],
         "content": [{"type": "reasoning_text", "text": tm.REASONING}]},
        {"type": "message", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "\nSure.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "status": "completed", "name": "get_weather",
         "arguments": json.dumps(tm.CALL_ARGUMENTS)}]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    assert (events[-1]["type"], whole["status"], whole["usage"]["output_tokens"]) == \
        ("response.completed", "completed", len(text))

    # Cut short (finish reason "length"): "incomplete", and so is the item it was writing.
    whole, events = run_reply(body, ["Hello", " there"], reason="length")
    assert (whole["status"], whole["incomplete_details"], events[-1]["type"]) == \
        ("incomplete", {"reason": "max_output_tokens"}, "response.incomplete")
    assert items_of(whole["output"]) == items_of(events[-1]["response"]["output"]) == [
        {"type": "message", "status": "incomplete", "role": "assistant",
         "content": [{"type": "output_text", "text": "Hello there", "annotations": [], "logprobs": []}]}]


def test_an_abandoned_call_is_text():
    """A call that streamed and then is no call (malformed): its item ends "incomplete", is left
    out of the output, and its text follows as a message; the text is chat's content, whole or
    streamed (streamed, the text before the call was a message of its own already)."""
    text = 'Hi\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    body = {"model": "llm", "input": QUESTION, "tools": TOOLS}
    whole, events = run_reply(body, list(text))
    assert [(e["item"]["type"], e["item"]["status"]) for e in events if e["type"] == "response.output_item.done"] \
        == [("message", "completed"), ("function_call", "incomplete"), ("message", "completed")]
    streamed = events[-1]["response"]["output"]
    assert [item["type"] for item in streamed] == ["message", "message"]
    assert [item["type"] for item in whole["output"]] == ["message"]
    assert "".join(item["content"][0]["text"] for item in streamed) == \
        whole["output"][0]["content"][0]["text"] == text


def items_of(output):
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output]


def test_agent_loop_matches_chat(client):
    r = respond(client, QUESTION, tools=TOOLS)
    expected = chat(client, tm.QUESTION, tools=tm.TOOLS)
    (call,) = expected.choices[0].message.tool_calls
    assert (r.object, r.status, r.model, r.error, r.incomplete_details) == ("response", "completed", "llm",
                                                                          None, None)
    assert r.id.startswith("resp_") and r.output[0].id.startswith("fc_")
    assert r.output[0].call_id.startswith("chatcmpl-tool-")
    assert items(r.output) == [{"type": "function_call", "status": "completed", "name": call.function.name,
                                "arguments": call.function.arguments}]
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == \
        (expected.usage.prompt_tokens, expected.usage.completion_tokens, expected.usage.total_tokens)
    assert [t.to_dict() for t in r.tools] == TOOLS and r.tool_choice == "auto"

    # The agent runs the tool and sends back the call and its output.
    r = respond(client, after_call(r.output[0]), tools=TOOLS)
    expected = chat(client, tm.after_call(), tools=tm.TOOLS).choices[0].message
    assert (expected.content, expected.model_extra["reasoning_content"]) == (tm.ANSWER, tm.REASONING)
    assert items(r.output) == [
        {"type": "reasoning", "status": "completed", "summary": [],
         "content": [{"type": "reasoning_text", "text": tm.REASONING}]},
        {"type": "message", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": tm.ANSWER, "annotations": [], "logprobs": []}]}]
    assert r.output_text == tm.ANSWER


def test_agent_loop_streamed(client):
    """The events in order, with their sequence numbers; the openai package's stream helper
    builds from them the same response that the last event carries."""
    with client.responses.stream(model="llm", instructions=INSTRUCTIONS, input=QUESTION, tools=TOOLS,
                                 temperature=0, max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == '{"city": "Paris"}' and len(deltas) > 1
    assert _types(events) == ["response.created", "response.in_progress", "response.output_item.added",
                              "response.function_call_arguments.delta", "response.function_call_arguments.done",
                              "response.output_item.done", "response.completed"]
    call = final.output[0]
    assert events[2].item.to_dict() == {"id": call.id, "type": "function_call", "status": "in_progress",
                                        "call_id": call.call_id, "name": "get_weather", "arguments": ""}
    assert items(events[-1].response.output) == [{"type": "function_call", "status": "completed",
                                                  "name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert items([events[-2].item]) == items(events[-1].response.output)
    assert (events[-1].response.output[0].id, events[-1].response.output[0].call_id) == \
        (events[-2].item.id, events[-2].item.call_id) == (call.id, call.call_id)
    assert events[-1].response.usage.output_tokens == respond(client, QUESTION, tools=TOOLS).usage.output_tokens

    events = list(client.responses.create(model="llm", instructions=INSTRUCTIONS, input=after_call(call),
                                          tools=TOOLS, temperature=0, max_output_tokens=64, stream=True))
    assert _types(events) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (text, reasoning) == (tm.ANSWER, tm.REASONING)
    assert items(events[-1].response.output) == items(respond(client, after_call(call), tools=TOOLS).output)


def _types(events):
    """Event types, a run of one delta type counted once."""
    types = [e.type for e in events]
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i and types[i - 1] == t)]


def test_text_reply_and_max_output_tokens(client):
    r = respond(client, [{"role": "user", "content": [{"type": "input_text", "text": "Hello!"}]}], tools=TOOLS)
    assert (r.status, r.output_text, len(r.output)) == ("completed", tm.GREETING_REPLY, 1)
    streamed = "".join(e.delta for e in respond(client, "Hello!", tools=TOOLS, stream=True)
                       if e.type == "response.output_text.delta")
    assert streamed == tm.GREETING_REPLY

    # Cut short: "incomplete", with the same text that chat gives with finish_reason "length".
    expected = chat(client, tm.GREETING, tools=tm.TOOLS, max_tokens=3).choices[0]
    r = respond(client, "Hello!", tools=TOOLS, max_output_tokens=3)
    assert (r.status, r.incomplete_details.reason, r.output[0].status, r.output_text) == \
        ("incomplete", "max_output_tokens", "incomplete", expected.message.content)
    assert expected.finish_reason == "length" and r.usage.output_tokens == 3
    last = list(respond(client, "Hello!", tools=TOOLS, max_output_tokens=3, stream=True))[-1]
    assert (last.type, last.response.status, last.response.output_text) == \
        ("response.incomplete", "incomplete", expected.message.content)


def test_json_schema_and_forced_function(client):
    """text.format json_schema is chat's response_format; a named tool_choice forces the call."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    r = respond(client, QUESTION, text={"format": {"type": "json_schema", "name": "place", "schema": schema}},
                extra_body=COMPACT)
    expected = chat(client, tm.QUESTION, response_format={
        "type": "json_schema", "json_schema": {"name": "place", "schema": schema}}, extra_body=COMPACT)
    assert r.output_text == expected.choices[0].message.content
    assert json.loads(r.output_text) in ({"city": "Paris"}, {"city": "Rome"})
    assert r.text.format.type == "json_schema"

    named = {"type": "function", "function": {"name": "get_weather"}}
    r = respond(client, QUESTION, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
                extra_body=COMPACT)
    expected = chat(client, tm.QUESTION, tools=tm.TOOLS, tool_choice=named, extra_body=COMPACT).choices[0]
    assert [(o.type, o.name, o.arguments) for o in r.output] == \
        [("function_call", "get_weather", expected.message.tool_calls[0].function.arguments)]

    # Cut short, the forced call is no call: its item ends "incomplete" and is left out of the
    # output, and its text is a message (as chat gives it as content).
    kw = dict(tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=8,
              extra_body=COMPACT)
    expected = chat(client, tm.GREETING, tools=tm.TOOLS, tool_choice=named, max_tokens=8,
                    extra_body=COMPACT).choices[0]
    assert (expected.finish_reason, expected.message.tool_calls) == ("length", None)
    message = [{"type": "message", "status": "incomplete", "role": "assistant", "content": [
        {"type": "output_text", "text": expected.message.content, "annotations": [], "logprobs": []}]}]
    assert items(respond(client, "Hello!", **kw).output) == message
    with client.responses.stream(model="llm", instructions=INSTRUCTIONS, input="Hello!", temperature=0,
                                 **kw) as stream:
        events = list(stream)
    final = events[-1].response  # get_final_response() wants response.completed: OpenAI's is not
    assert (events[-1].type, final.status, items(final.output)) == ("response.incomplete", "incomplete", message)
    assert [(e.type, e.item.type, e.item.status) for e in events if e.type == "response.output_item.done"] == \
        [("response.output_item.done", "function_call", "incomplete"),
         ("response.output_item.done", "message", "incomplete")]


@pytest.mark.parametrize("kw, message, param", [
    ({"previous_response_id": "resp_1"},
     "previous_response_id is not supported: this server stores no responses (store is accepted, and "
     "nothing is kept); send the whole conversation in input", "previous_response_id"),
    ({"tools": [{"type": "web_search"}]},
     "tools.0: tools of type 'web_search' are not supported: this server serves function tools only",
     "tools.0.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]},
     "input.0: input items of type 'item_reference' are not supported (this server takes messages, "
     "function_call, function_call_output and reasoning items)", "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]},
     "input.0.content.0 is an image (type 'input_image'), and this model takes text only", "input.0.content.0"),
    ({"include": ["reasoning.encrypted_content"]},
     "include: 'reasoning.encrypted_content' is not supported (nothing can be included)", "include"),
    ({"background": True}, "background is not supported by this server", "background"),
    ({"extra_body": {"use_beam_search": True}}, "use_beam_search is not supported by this server", "use_beam_search"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format json_schema needs a schema (an object)", "text.format.schema"),
    # The engine's message, in the Responses API's field name.
    ({"max_output_tokens": 0}, "max_output_tokens must be at least 1, got 0.", "max_output_tokens"),
])
def test_refused(client, kw, message, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": "llm", "input": "Hello!", **kw})
    error = e.value.body
    assert (error["type"], error["param"], error["message"]) == ("invalid_request_error", param, message)


def test_store_is_accepted(client):
    """store is accepted (nothing is kept: see test_refused's previous_response_id)."""
    assert respond(client, "Hello!", tools=TOOLS, store=True).output_text == tm.GREETING_REPLY
    assert respond(client, "Hello!", tools=TOOLS, store=False).output_text == tm.GREETING_REPLY


def test_openai_agents_sdk(tool_stack):
    """The Agents SDK's agent loop (Runner.run_sync: call, run the tool, answer) over /v1/responses."""
    from agents import Agent, FunctionTool, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    calls = []

    async def get_weather(_context, arguments: str) -> str:
        calls.append(arguments)
        return tm.TOOL_RESULT

    tool = FunctionTool(name=TOOLS[0]["name"], description=TOOLS[0]["description"],
                        params_json_schema=TOOLS[0]["parameters"], on_invoke_tool=get_weather,
                        strict_json_schema=False)

    def agent():  # a client per event loop: each run below has its own
        model = OpenAIResponsesModel(model="llm", openai_client=AsyncOpenAI(
            api_key="none", base_url=tool_stack[1].url + "/v1", max_retries=0, timeout=120))
        return Agent(name="weather", instructions=INSTRUCTIONS, tools=[tool], model=model,
                     model_settings=ModelSettings(temperature=0, max_tokens=64))

    result = Runner.run_sync(agent(), QUESTION)
    assert (calls, result.final_output) == (['{"city": "Paris"}'], tm.ANSWER)
    assert [item.type for item in result.new_items] == \
        ["tool_call_item", "tool_call_output_item", "reasoning_item", "message_output_item"]

    async def streamed():
        run = Runner.run_streamed(agent(), QUESTION)
        return [e async for e in run.stream_events()], run.final_output
    _, final_output = asyncio.run(streamed())
    assert (calls[1:], final_output) == (['{"city": "Paris"}'], tm.ANSWER)
