"""Tool-call and reasoning parsers without a server: whole replies, and the same replies cut
into pieces at every place (tags and JSON split anywhere) give the same message."""
import json
import random
import re

import pytest

from tritium.frontend.chat_output import ChatParsing, ChoiceOutput
from tritium.frontend.errors import OpenAIError
from tritium.frontend.protocol import ChatCompletionRequest, parse_body
from tritium.frontend.reasoning import ReasoningParser
from tritium.frontend.tool_parsers import (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                                   NamedToolParser, PythonicToolParser, Qwen3CoderToolParser,
                                   RequiredToolParser, required_schema)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET", "nested": {"a": [1, "}"]}}}'


def run(make, pieces, reasoning=None, output=False):
    """The message of `pieces` through a fresh parser, and every delta on the way (and the
    ChoiceOutput, with `output`)."""
    out = ChoiceOutput(reasoning() if reasoning else None, make() if make else None)
    deltas = [out.start()] + [out.feed(p) for p in pieces] + [out.finish()]
    return (out.as_message(), deltas) + ((out,) if output else ())


def assembled(deltas):
    """What a client makes of the streamed deltas: the content, and each call's (name, arguments)."""
    calls = {}
    for d in deltas:
        for c in d.tool_calls:
            calls[c.index] = (c.name, c.arguments) if c.name is not None else \
                (calls[c.index][0], calls[c.index][1] + c.arguments)
    return "".join(d.content for d in deltas), [calls[i] for i in sorted(calls)]


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
    """The message of the whole text; cut anywhere, the same message, and the streamed deltas
    put together are that message too (but for calls abandoned: see the cut-off tests)."""
    whole, _ = run(make, [text], reasoning)
    for pieces in splits(text):
        message, deltas, out = run(make, pieces, reasoning, output=True)
        assert _without_ids(message) == _without_ids(whole), pieces
        _check_deltas(deltas)
        if out.tools is None or not out.tools.abandoned:
            content, calls = assembled(deltas)
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] \
                == calls
            assert message["content"] == (content if content.strip() or not calls else None)
    return whole


def _without_ids(message):
    m = json.loads(json.dumps(message))
    for call in m.get("tool_calls", []):
        # vLLM's ids; Mistral's chat templates take 9 letters and digits only
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}|[A-Za-z0-9]{9}", call["id"])
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


def test_hermes_a_call_whose_json_does_not_parse_stays_text():
    """As vLLM's parser: a <tool_call> whose body is not a JSON call object is text, also once
    its arguments began streaming (see test_a_cut_off_call_stays_text)."""
    for text in ['<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',  # a brace short
                 'Look: <tool_call>{"name": "f", "arguments": {"a": 1}} x</tool_call>',  # text after it
                 '<tool_call>{"name": "f", "arguments": {"a": [1, ']:  # cut short (max_tokens)
        assert same_for_every_split(HermesToolParser, text) == {"role": "assistant", "content": text}
    m = same_for_every_split(HermesToolParser, '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>')
    assert _without_ids(m)["tool_calls"] == [call("f", '{"a": 1}')]


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
        {"role": "assistant", "content": "It is sunny.", "reasoning": "Sunny, 22.",
         "reasoning_content": "Sunny, 22."}
    assert message("No thinking here.", qwen3()) == \
        {"role": "assistant", "content": "No thinking here.", "reasoning": None, "reasoning_content": None}
    # The template opened <think> in the prompt: the reply starts thinking.
    assert message("Sunny.</think>It is.", qwen3("<|im_start|>assistant\n<think>\n")) == \
        {"role": "assistant", "content": "It is.", "reasoning": "Sunny.", "reasoning_content": "Sunny."}
    # enable_thinking=False closes an empty thinking in the prompt.
    assert message("It is.", qwen3("<think>\n\n</think>\n\n")) == \
        {"role": "assistant", "content": "It is.", "reasoning": None, "reasoning_content": None}
    r1 = lambda: ReasoningParser.create("deepseek_r1", "")  # noqa: E731
    assert message("Hmm, cut short", r1) == \
        {"role": "assistant", "content": "", "reasoning": "Hmm, cut short",
         "reasoning_content": "Hmm, cut short"}
    assert message("<think>A</think>B", r1) == \
        {"role": "assistant", "content": "B", "reasoning": "A", "reasoning_content": "A"}


def test_reasoning_then_a_tool_call():
    m = same_for_every_split(HermesToolParser, f"<think>I need the weather.</think>\n<tool_call>\n{WEATHER}\n</tool_call>",
                             qwen3())
    assert _without_ids(m) == {"role": "assistant", "content": None,
                               "reasoning": "I need the weather.", "reasoning_content": "I need the weather.",
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
    with pytest.raises(ValueError, match="--tool-call-parser 'granite' is not one of hermes, llama3_json, "
                                         "mistral, pythonic, qwen3_coder"):
        ChatParsing("granite")


def test_history_reaches_the_template_with_arguments_as_objects():
    from tritium.frontend.chat import template_messages
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
    from tritium.frontend.cli import config_from, parse_args
    config = config_from(parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
                                     "--reasoning-parser", "deepseek_r1"]))
    assert config.parsing == ChatParsing("llama3_json", True, "deepseek_r1")
    config = config_from(parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
                                     "--exclude-tools-when-tool-choice-none"]))
    assert config.parsing == ChatParsing("qwen3_coder", True, None, exclude_tools_when_tool_choice_none=True)
    with pytest.raises(SystemExit, match="python -m frontend: --enable-auto-tool-choice needs --tool-call-parser"):
        config_from(parse_args(["--enable-auto-tool-choice"]))


# Issue 48: cut-off calls, and the mistral, pythonic and qwen3_coder parsers.

WEATHER_TOOLS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hot": {"type": "boolean"},
    "temp": {"type": "number"}, "where": {"type": "object"}, "tags": {"type": "array"}}}}]


def qwen3_coder():
    return Qwen3CoderToolParser(WEATHER_TOOLS)


def named():
    return NamedToolParser("get_weather")


@pytest.mark.parametrize("make, text, streamed", [
    (HermesToolParser, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     [("get_weather", '{"city": "Par')]),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Par', [("get_weather", '{"city": "Par')]),
    (Llama3JsonToolParser, '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"ci',
     [("get_time", "{}"), ("get_weather", '{"ci')]),
    (MistralToolParser, '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', [("get_weather", '{"city": "Par')]),
    (MistralToolParser, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par',
     [("get_weather", '{"city": "Par')]),
    (PythonicToolParser, '[get_weather(city="Par', []),
    (PythonicToolParser, '[get_time(zone="CET"), get_weather(city="Par', [("get_time", '{"zone": "CET"}')]),
    (qwen3_coder, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=da",
     [("get_weather", '{"city": "Paris"')]),
    (RequiredToolParser, '[{"name": "get_weather", "parameters": {"city": "Par', [("get_weather", '{"city": "Par')]),
    (named, '{"city": "Par', [("get_weather", '{"city": "Par')]),
])
def test_a_cut_off_call_stays_text(make, text, streamed):
    """A reply that ends inside a call (end of sequence, or max_tokens) has no call: its text is
    the content, and finish_reason is the engine's. Streamed, what went out as a call's
    arguments cannot be taken back: the same text follows as content, and finish_reason is
    still not "tool_calls", so a client can tell (the same holds for text cut anywhere)."""
    for pieces in splits(text):
        message, deltas, out = run(make, pieces, output=True)
        assert message == {"role": "assistant", "content": text}, pieces
        assert (out.finish_reason("stop"), out.finish_reason("length")) == ("stop", "length")
        assert assembled(deltas) == (text, streamed), pieces


def test_a_whole_call_stays_a_call_beside_a_cut_off_one():
    text = f'<tool_call>{WEATHER}</tool_call>\n<tool_call>{{"name": "get_time", "arguments": {{"zone": "C'
    message, deltas, out = run(HermesToolParser, [text], output=True)
    assert _without_ids(message) == {"role": "assistant", "tool_calls": [call("get_weather", '{"city": "Paris"}')],
                                     "content": '\n<tool_call>{"name": "get_time", "arguments": {"zone": "C'}
    assert out.finish_reason("stop") == "stop"  # one call was abandoned
    assert assembled(deltas) == (message["content"], [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "C')])
    # tool_choice "required" cut short by max_tokens: the calls written whole.
    message, _, out = run(RequiredToolParser, ['[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "param'],
                          output=True)
    assert _without_ids(message) == {"role": "assistant", "content": '{"name": "b", "param',
                                     "tool_calls": [call("a", '{"x": 1}')]}
    assert out.finish_reason("length") == "length"


def test_mistral_calls_in_each_format():
    for text in ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',  # before v11
                 '[TOOL_CALLS] [{"arguments": {"city": "Paris"}, "name": "get_weather"}]',
                 '[TOOL_CALLS]get_weather{"city": "Paris"}',  # v11
                 '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}']:  # newer templates
        m = same_for_every_split(MistralToolParser, text)
        assert _without_ids(m) == {"role": "assistant", "content": None,
                                   "tool_calls": [call("get_weather", '{"city": "Paris"}')]}
        assert re.fullmatch("[A-Za-z0-9]{9}", m["tool_calls"][0]["id"])
    m = same_for_every_split(MistralToolParser, 'Let me look. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
                                                '[TOOL_CALLS]get_time[ARGS]{"zone": "[TOOL_CALLS]}"}')
    assert _without_ids(m) == {"role": "assistant", "content": "Let me look.", "tool_calls": [
        call("get_weather", '{"city": "Paris"}'), call("get_time", '{"zone": "[TOOL_CALLS]}"}')]}
    m = same_for_every_split(MistralToolParser, '[TOOL_CALLS] [{"name": "a", "arguments": {"x": [1]}}, '
                                                '{"name": "b"}]\nDone.')
    assert _without_ids(m) == {"role": "assistant", "content": "\nDone.",
                               "tool_calls": [call("a", '{"x": [1]}'), call("b", "{}")]}


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS]get weather{"city": "Paris"}',  # no name
    '[TOOL_CALLS]get_weather{"city": Paris}',  # not JSON (streamed first, then abandoned)
    '[TOOL_CALLS][{"name": "get_weather", "arguments": "Paris"}]',
    "[TOOL_CALLS]  ",
    "A [TOOL text",
])
def test_mistral_what_is_not_a_call_stays_text(text):
    assert same_for_every_split(MistralToolParser, text) == {"role": "assistant", "content": text}


def test_mistral_keeps_special_tokens_in_the_text():
    """[TOOL_CALLS] is a special token: as vLLM's adjust_request, the request keeps them."""
    sampling = {}
    ChatParsing("mistral", True).adjust_sampling(request(tools=TOOLS), sampling)
    assert sampling == {"skip_special_tokens": False}
    for parsing, req in [(ChatParsing("mistral", True), request(tools=TOOLS, tool_choice="none")),
                         (ChatParsing("mistral", True), request()), (ChatParsing("hermes", True), request(tools=TOOLS))]:
        sampling = {}
        parsing.adjust_sampling(req, sampling)
        assert sampling == {}


def test_pythonic_calls():
    m = same_for_every_split(PythonicToolParser, '[get_weather(city="Paris")]')
    assert _without_ids(m) == {"role": "assistant", "content": None,
                               "tool_calls": [call("get_weather", '{"city": "Paris"}')]}
    m = same_for_every_split(PythonicToolParser, "\n[get_weather(city='Par\\'is)]', days=-3), "
                                                 'get_time(zone="""C"E)T""", when=None, '
                                                 'opts={"a": [1, (2, 3.5)], "b": True})]')
    assert _without_ids(m) == {"role": "assistant", "content": None, "tool_calls": [
        call("get_weather", '{"city": "Par\'is)]", "days": -3}'),
        call("get_time", '{"zone": "C\\"E)T", "when": null, "opts": {"a": [1, [2, 3.5]], "b": true}}')]}


@pytest.mark.parametrize("text", [
    'Sure: [get_weather(city="Paris")]',  # the whole reply must be the list
    '[get_weather(city="Paris")] and more',
    "[get_weather(city=paris)]",  # a name, not a literal: never evaluated
    '[get_weather("Paris")]',  # positional
    '[os.system(command="ls")]',
    "[get_weather(**kwargs)]",
    "[get_weather(days={1, 2})]",  # a set: not JSON
    "[get_weather(days=1e999)]",  # infinity: not JSON
    "[]",
    "Plain text.",
])
def test_pythonic_what_is_not_a_call_stays_text(text):
    assert same_for_every_split(PythonicToolParser, text) == {"role": "assistant", "content": text}


QWEN3_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n<parameter=hot>\nTrue\n</parameter>\n"
              "<parameter=temp>\n21.0\n</parameter>\n<parameter=where>\n{\"lat\": 48.9}\n</parameter>\n"
              "<parameter=tags>\n['a', \"b\"]\n</parameter>\n<parameter=note>\nif a < b:\n    x = null\n"
              "</parameter>\n<parameter=unit>\nnull\n</parameter>\n</function>\n</tool_call>")
QWEN3_ARGUMENTS = ('{"city": "Paris", "days": 3, "hot": true, "temp": 21, "where": {"lat": 48.9}, '
                   '"tags": ["a", "b"], "note": "if a < b:\\n    x = null", "unit": null}')


def test_qwen3_coder_calls_with_values_typed_by_the_schema():
    m = same_for_every_split(qwen3_coder, "Let me check.\n" + QWEN3_CALL)
    assert _without_ids(m) == {"role": "assistant", "content": "Let me check.",
                               "tool_calls": [call("get_weather", QWEN3_ARGUMENTS)]}
    # Streamed: the name, then one whole parameter at a time.
    _, deltas, out = run(qwen3_coder, [QWEN3_CALL], output=True)
    assert [c.arguments for d in deltas for c in d.tool_calls][:3] == ["", '{"city": "Paris"', ', "days": 3']
    assert out.finish_reason("stop") == "tool_calls"
    two = ("<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
           "<parameter=city>\nParis\n<parameter=days>\nthree\n</function>\n")  # tags left out
    m = same_for_every_split(qwen3_coder, two)
    assert _without_ids(m) == {"role": "assistant", "content": None, "tool_calls": [
        call("get_time", "{}"), call("get_weather", '{"city": "Paris", "days": "three"}')]}


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',  # Hermes' shape
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\nmore</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n<parameter=city>\nB\n</parameter>\n"
    "</function>\n</tool_call>",  # a parameter twice
    "<tool_call>\n<function=get weather>\n</function>\n</tool_call>",
    "<function=get_weather>\n</function>",  # not in a <tool_call>
    "a <tool_",
])
def test_qwen3_coder_what_is_not_a_call_stays_text(text):
    assert same_for_every_split(qwen3_coder, text) == {"role": "assistant", "content": text}


@pytest.mark.parametrize("value, schema, expected", [
    ("3", {"type": "integer"}, 3), ("three", {"type": "integer"}, "three"), ("2.5", {"type": "number"}, 2.5),
    ("2.0", {"type": "number"}, 2), ("nan", {"type": "number"}, "nan"), ("TRUE", {"type": "boolean"}, True),
    ("yes", {"type": "boolean"}, False), ('{"a": 1}', {"type": "object"}, {"a": 1}),
    ("{'a': (1, 2)}", {"type": "object"}, {"a": [1, 2]}), ("{1, 2}", {"type": "array"}, "{1, 2}"),
    ("NULL", {"type": "string"}, None), ("42", {"type": "string"}, "42"), ("42", None, "42"),
    ("42", {"type": ["integer", "null"]}, 42),
])
def test_qwen3_coder_parameter_values(value, schema, expected):
    from tritium.frontend.tool_parsers.qwen3_coder import parameter_value
    assert json.loads(json.dumps(parameter_value(value, schema))) == expected


def test_tool_choice_none_keeps_the_tools_in_the_prompt(tiny_model):
    """vLLM's default: the template still gets the tools, no reply is parsed for calls;
    --exclude-tools-when-tool-choice-none leaves them out."""
    from tritium.frontend.chat import chat_text
    from tritium.frontend.model_registry import ServedModel
    from scripts import tool_chat_formats as tm
    model = ServedModel("m", True, tiny_model, chat_template=tm.HERMES.template)
    req = request(tools=TOOLS, tool_choice="none")
    tail = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert chat_text(model, req, ChatParsing("hermes", True)) == (
        '<|im_start|>system\n# Tools\n<tools>{"type": "function", "function": {"name": "get_weather", '
        '"parameters": {"type": "object"}}}</tools>\nCall: <tool_call>{"name": <function-name>, '
        '"arguments": <args-json-object>}</tool_call><|im_end|>\n' + tail)
    assert ChatParsing("hermes", True).for_request(req, "")().tools is None
    assert chat_text(model, req, ChatParsing("hermes", True, exclude_tools_when_tool_choice_none=True)) == tail
