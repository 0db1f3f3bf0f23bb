"""Tool-call and reasoning parsers without a server: whole replies, and the same replies cut
into pieces at every place (tags and JSON split anywhere) give the same message."""
import json
import random

import pytest

from frontend.chat_output import ChatParsing, ChoiceOutput
from frontend.errors import OpenAIError
from frontend.protocol import ChatCompletionRequest, parse_body
from frontend.reasoning import ReasoningParser
from frontend.tool_parsers import (HermesToolParser, Llama3JsonToolParser, RequiredToolParser,
                                   required_schema)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET", "nested": {"a": [1, "}"]}}}'


def run(make, pieces, reasoning=None):
    """The message of `pieces` through a fresh parser, and every delta on the way."""
    out = ChoiceOutput(reasoning() if reasoning else None, make() if make else None)
    deltas = [out.start()] + [out.feed(p) for p in pieces] + [out.finish()]
    return out.as_message(), deltas


def splits(text):
    """The text whole, cut in two at every place, one character at a time, and randomly."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def same_for_every_split(make, text, reasoning=None):
    whole, _ = run(make, [text], reasoning)
    for pieces in splits(text):
        message, deltas = run(make, pieces, reasoning)
        assert _without_ids(message) == _without_ids(whole), pieces
        _check_deltas(deltas)
    return whole


def _without_ids(message):
    m = json.loads(json.dumps(message))
    for call in m.get("tool_calls", []):
        assert call["id"].startswith("chatcmpl-tool-")
        del call["id"]
    return m


def _check_deltas(deltas):
    """Each call's first delta carries its id, type and name; later ones arguments only."""
    seen = set()
    for d in deltas:
        for call in d.tool_calls:
            if call.index not in seen:
                assert call.name and call.id and call.index == len(seen)
                seen.add(call.index)
            else:
                assert call.name is None and call.id is None


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_hermes_one_call_text_around_and_several_calls():
    m = same_for_every_split(HermesToolParser, f"<tool_call>\n{WEATHER}\n</tool_call>")
    assert _without_ids(m) == {"role": "assistant", "content": None,
                               "tool_calls": [call("get_weather", '{"city": "Paris"}')]}
    m = same_for_every_split(HermesToolParser, f"Let me look.\n<tool_call>{WEATHER}</tool_call>\n"
                                               f"<tool_call>\n{TIME}\n</tool_call>\n")
    assert _without_ids(m) == {"role": "assistant", "content": "Let me look.", "tool_calls": [
        call("get_weather", '{"city": "Paris"}'),
        call("get_time", '{"zone": "CET", "nested": {"a": [1, "}"]}}')]}


def test_hermes_arguments_are_streamed_as_written():
    _, deltas = run(HermesToolParser, ["<tool_call>", '{"name": "get_weather", ', '"arguments": {"ci',
                                       'ty": "Pa', 'ris"}}', "</tool_call>"])
    calls = [c for d in deltas for c in d.tool_calls]
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"ci'), (None, 'ty": "Pa'), (None, 'ris"}')]


@pytest.mark.parametrize("text", [
    "<tool_call>not json</tool_call>",
    '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": "a=1"}</tool_call> and more',  # not an object
    '<tool_call>["name", "f"]</tool_call>',
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    "a < b and <tool_ca",
    "plain text, trailing space  \n",
])
def test_hermes_what_is_not_a_call_stays_text(text):
    m = same_for_every_split(HermesToolParser, text)
    assert m == {"role": "assistant", "content": text}


def test_hermes_text_after_a_call():
    m = same_for_every_split(HermesToolParser, f"<tool_call>{WEATHER}</tool_call>\nDone. a <tool")
    assert m["content"] == "\nDone. a <tool"
    m = same_for_every_split(HermesToolParser, f"<tool_call>{WEATHER}</tool_call> \n")
    assert m["content"] is None


def test_hermes_a_call_is_a_call_once_its_arguments_open():
    """Streaming commits to a call once its name and the brace of its arguments are out; the
    whole reply parsed at once says the same, whatever follows."""
    m = same_for_every_split(HermesToolParser, '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>')
    assert _without_ids(m)["tool_calls"] == [call("f", '{"a": 1}')]
    m = same_for_every_split(HermesToolParser, '<tool_call>{"name": "f", "arguments": {"a": 1}} x</tool_call>')
    assert _without_ids(m)["tool_calls"] == [call("f", '{"a": 1}')]
    m = same_for_every_split(HermesToolParser, '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>')
    assert _without_ids(m)["tool_calls"] == [call("f", '{"a": 1}')]
    # Cut short (max_tokens): the arguments as far as they were written.
    m = same_for_every_split(HermesToolParser, '<tool_call>{"name": "f", "arguments": {"a": [1, ')
    assert _without_ids(m)["tool_calls"] == [call("f", '{"a": [1, ')]


def test_hermes_an_unclosed_call_at_the_end():
    m = same_for_every_split(HermesToolParser, f"<tool_call>\n{WEATHER}\n")
    assert _without_ids(m)["tool_calls"] == [call("get_weather", '{"city": "Paris"}')]


def test_llama3_json_calls():
    for text in ['{"name": "get_weather", "parameters": {"city": "Paris"}}',
                 '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}']:
        m = same_for_every_split(Llama3JsonToolParser, text)
        assert _without_ids(m) == {"role": "assistant", "content": None,
                                   "tool_calls": [call("get_weather", '{"city": "Paris"}')]}
    m = same_for_every_split(Llama3JsonToolParser, '{"name": "a", "parameters": {"x": 1}}; '
                                                   '{"name": "b", "parameters": {}}')
    assert [c["function"] for c in m["tool_calls"]] == [{"name": "a", "arguments": '{"x": 1}'},
                                                        {"name": "b", "arguments": "{}"}]


@pytest.mark.parametrize("text", ['The answer is {"name": "x"}', '{"answer": 42}',
                                  '{"name": "a"} and then text', '{"name": 3, "parameters": {}}',
                                  "  "])
def test_llama3_json_what_is_not_a_call_stays_text(text):
    assert same_for_every_split(Llama3JsonToolParser, text) == {"role": "assistant", "content": text}


def test_required_call_array_and_its_schema():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y": "]"}}]'
    m = same_for_every_split(RequiredToolParser, text)
    assert [c["function"] for c in m["tool_calls"]] == [{"name": "a", "arguments": '{"x": 1}'},
                                                        {"name": "b", "arguments": '{"y": "]"}'}]
    cut = '[{"name": "a", "param'
    assert run(RequiredToolParser, [cut])[0] == {"role": "assistant", "content": cut}
    params = {"type": "object", "properties": {"x": {"$ref": "#/$defs/X"}}, "$defs": {"X": {"type": "integer"}}}
    assert required_schema([{"name": "a", "parameters": params}, {"name": "b"}]) == {
        "type": "array", "minItems": 1, "$defs": {"X": {"type": "integer"}}, "items": {"type": "object", "anyOf": [
            {"type": "object", "required": ["name", "parameters"], "properties": {
                "name": {"type": "string", "enum": ["a"]},
                "parameters": {"type": "object", "properties": {"x": {"$ref": "#/$defs/X"}}}}},
            {"type": "object", "required": ["name", "parameters"], "properties": {
                "name": {"type": "string", "enum": ["b"]},
                "parameters": {"type": "object", "properties": {}}}}]}}


def qwen3(prompt=""):
    return lambda: ReasoningParser.create("qwen3", prompt)


def test_reasoning_qwen3_and_deepseek_r1():
    def message(text, reasoning):
        return same_for_every_split(None, text, reasoning)

    assert message("<think>Sunny, 22.</think>It is sunny.", qwen3()) == \
        {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Sunny, 22."}
    assert message("No thinking here.", qwen3()) == \
        {"role": "assistant", "content": "No thinking here.", "reasoning_content": None}
    # The template opened <think> in the prompt: the reply starts thinking.
    assert message("Sunny.</think>It is.", qwen3("<|im_start|>assistant\n<think>\n")) == \
        {"role": "assistant", "content": "It is.", "reasoning_content": "Sunny."}
    # enable_thinking=False closes an empty thinking in the prompt.
    assert message("It is.", qwen3("<think>\n\n</think>\n\n")) == \
        {"role": "assistant", "content": "It is.", "reasoning_content": None}
    r1 = lambda: ReasoningParser.create("deepseek_r1", "")  # noqa: E731
    assert message("Hmm, cut short", r1) == \
        {"role": "assistant", "content": "", "reasoning_content": "Hmm, cut short"}
    assert message("<think>A</think>B", r1) == {"role": "assistant", "content": "B", "reasoning_content": "A"}


def test_reasoning_then_a_tool_call():
    m = same_for_every_split(HermesToolParser, f"<think>I need the weather.</think>\n<tool_call>\n{WEATHER}\n</tool_call>",
                             qwen3())
    assert _without_ids(m) == {"role": "assistant", "content": None,
                               "reasoning_content": "I need the weather.",
                               "tool_calls": [call("get_weather", '{"city": "Paris"}')]}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def request(**fields):
    return parse_body(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                              **fields})


def test_tool_choice_needs_the_flags_for_auto():
    with pytest.raises(OpenAIError, match='"auto" tool choice requires --enable-auto-tool-choice and '
                                          "--tool-call-parser to be set"):
        ChatParsing().for_request(request(tools=TOOLS), "")
    auto = ChatParsing("hermes", True).for_request(request(tools=TOOLS), "")()
    assert isinstance(auto.tools, HermesToolParser)
    assert ChatParsing().for_request(request(tools=TOOLS, tool_choice="none"), "")().tools is None
    assert isinstance(ChatParsing().for_request(request(tools=TOOLS, tool_choice="required"), "")().tools,
                      RequiredToolParser)
    # Guided output has no thinking: the reasoning parser stays out of it.
    assert ChatParsing(reasoning_parser="qwen3").for_request(
        request(tools=TOOLS, tool_choice="required"), "")().reasoning is None
    assert ChatParsing(reasoning_parser="qwen3").for_request(
        request(response_format={"type": "json_object"}), "")().reasoning is None
    assert ChatParsing(reasoning_parser="qwen3").for_request(
        request(structured_outputs={"disable_any_whitespace": True}), "")().reasoning is not None
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ChatParsing(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="--tool-call-parser 'mistral' is not one of hermes, llama3_json"):
        ChatParsing("mistral")


def test_history_reaches_the_template_with_arguments_as_objects():
    from frontend.chat import template_messages
    req = request(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    assert template_messages(req)[1:] == [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def test_the_frontend_flags():
    from frontend.cli import config_from, parse_args
    config = config_from(parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
                                     "--reasoning-parser", "deepseek_r1"]))
    assert config.parsing == ChatParsing("llama3_json", True, "deepseek_r1")
    with pytest.raises(SystemExit, match="python -m frontend: --enable-auto-tool-choice needs --tool-call-parser"):
        config_from(parse_args(["--enable-auto-tool-choice"]))
