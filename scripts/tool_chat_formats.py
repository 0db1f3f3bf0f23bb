"""The tool-using conversation the tiny tool models learn (scripts/build_tool_model.py), and the
two chat formats they learn it in: Hermes-style (Qwen2.5's layout; `--tool-call-parser hermes`)
and Llama 3.1's JSON calls (`--tool-call-parser llama3_json`). The tests send these messages."""
from __future__ import annotations

import json
from dataclasses import dataclass

# The request's tools as the frontend hands them to the template (its fields in this order).
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
QUESTION = [SYSTEM, {"role": "user", "content": "What is the weather in Paris?"}]
CALL_ARGUMENTS = {"city": "Paris"}
TOOL_RESULT = json.dumps({"temperature": 22, "condition": "sunny"})
REASONING = "The tool says 22 and sunny."
ANSWER = "It is sunny and 22 degrees in Paris."
GREETING = [SYSTEM, {"role": "user", "content": "Hello!"}]
GREETING_REPLY = "Hello! Ask me about the weather."


def after_call(call_id: str = "call_0") -> list[dict]:
    """The conversation once the assistant has called get_weather and the tool has answered."""
    return QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": CALL_ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT}]


@dataclass(frozen=True)
class ChatFormat:
    """A chat template and the replies a model learns in it."""

    parser: str  # the --tool-call-parser that reads its calls
    model_dir: str  # under models/
    template: str
    special_tokens: tuple[str, ...]  # turn markers: left out of decoded text
    tags: tuple[str, ...]  # tool and thinking tags: kept in decoded text
    eos: str
    call: str  # the reply that calls get_weather
    answer: str  # the reply once the tool has answered

    def examples(self) -> list[tuple[list[dict], str]]:
        """(messages, the assistant's reply) the model learns."""
        return [(QUESTION, self.call), (after_call(), self.answer), (GREETING, GREETING_REPLY)]


# Hermes-style, in the shape of Qwen2.5's template (shortened).
HERMES = ChatFormat(
    parser="hermes", model_dir="tiny-tool-llama",
    template=(
        "{% if tools %}<|im_start|>system\n"
        "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
        "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
        "Call: <tool_call>{\"name\": <function-name>, \"arguments\": <args-json-object>}</tool_call>"
        "<|im_end|>\n"
        "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
        "{% endif %}"
        "{% for message in messages %}"
        "{% if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
        "{% for call in message.tool_calls or [] %}<tool_call>\n"
        "{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}\n"
        "</tool_call>{% endfor %}<|im_end|>\n"
        "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
        "</tool_response><|im_end|>\n"
        "{% elif message.role != 'system' %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    special_tokens=("<|im_start|>", "<|im_end|>"),
    tags=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"),
    eos="<|im_end|>",
    call="<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": CALL_ARGUMENTS}) + "\n</tool_call>",
    answer=f"<think>{REASONING}</think>{ANSWER}")

# Llama 3.1's layout (shortened): the functions in the first user turn, a call as the whole
# reply, the tool's result in an `ipython` turn.
LLAMA3_JSON = ChatFormat(
    parser="llama3_json", model_dir="tiny-tool-llama3",
    template=(
        "<|begin_of_text|>{% set ns = namespace(first=true) %}"
        "{% for message in messages %}"
        "{% if message.role == 'system' %}<|start_header_id|>system<|end_header_id|>\n\n"
        "{{ message.content }}<|eot_id|>"
        "{% elif message.role == 'user' %}<|start_header_id|>user<|end_header_id|>\n\n"
        "{% if tools and ns.first %}Functions:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
        "Respond with {\"name\": function name, \"parameters\": its arguments}.\n\n"
        "{% set ns.first = false %}{% endif %}{{ message.content }}<|eot_id|>"
        "{% elif message.role == 'assistant' %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{% for call in message.tool_calls or [] %}"
        "{\"name\": \"{{ call.function.name }}\", \"parameters\": {{ call.function.arguments | tojson }}}"
        "{% endfor %}{{ message.content or '' }}<|eot_id|>"
        "{% elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
        "{{ message.content }}<|eot_id|>"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    special_tokens=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                    "<|python_tag|>"),
    tags=(),
    eos="<|eot_id|>",
    call=json.dumps({"name": "get_weather", "parameters": CALL_ARGUMENTS}),
    answer=ANSWER)

FORMATS = {f.parser: f for f in (HERMES, LLAMA3_JSON)}
