"""Qwen3-Coder's XML calls (vLLM's `qwen3_coder` parser), one or more, around plain text:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is the text between its tags (less one newline at each end), converted by
the type the request's tool schema gives that parameter, as vLLM converts it."""
from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from tritium.frontend.tool_parsers.base import DeltaMessage, TaggedToolParser

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_NAME = re.compile(r"[^\s<>]*")  # a function's or parameter's name, as far as it is written


class Qwen3CoderToolParser(TaggedToolParser):
    """A call streams from its function's name on: its arguments grow by one whole parameter at
    a time (vLLM's streaming), and close at `</function>`. A `<tool_call>` that is not one
    function of that shape (cut off, or another shape) is text; abandoned once streamed."""

    tag = START

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)  # phases in a call: head, params, value, done, or bad
        self._index: int | None = None  # once the current call streams
        self._name, self._param = "", ""
        self._params: dict[str, Any] = {}
        self._seen = 0  # how far into the current value its end was looked for

    def _begin(self) -> None:
        self._phase, self._index = "head", None
        self._name, self._params = "", {}

    def _step(self, out: DeltaMessage, final: bool) -> bool:
        rest = self._text[self._at:]
        if self._phase == "value":
            since = max(0, self._seen - len(PARAMETER_END))  # a long value is searched once
            ends = [i for i in (rest.find(t, since) for t in (PARAMETER_END, PARAMETER, FUNCTION_END)) if i >= 0]
            if not ends:
                self._seen = len(rest)
                self._phase = "bad" if final else "value"
                return final
            value = rest[:min(ends)]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            if self._param in self._params:  # streamed arguments cannot take a value back
                self._phase = "bad"
                return True
            self._params[self._param] = parameter_value(value, self._schema().get(self._param))
            self._stream(out, json.dumps(self._params, ensure_ascii=False)[:-1])
            self._at += min(ends) + (len(PARAMETER_END) if rest.startswith(PARAMETER_END, min(ends)) else 0)
            self._phase = "params"
            return True
        if self._phase == "bad":  # text up to the end of this <tool_call>
            end = self._text.find(END, self._at)
            if end < 0 and not final:
                return False
            end = len(self._text) if end < 0 else end + len(END)
            text = self._call_text(end)
            out.extend(self._abandon([self._index], text) if self._index is not None else DeltaMessage(text))
            self._at, self._phase = end, "text"
            return True
        body = rest.lstrip()
        skip = len(rest) - len(body)
        if self._phase == "done" and final and not body:  # whole, its </tool_call> left out
            self._at, self._phase = len(self._text), "text"
            return True
        expected = {"head": (FUNCTION,), "params": (PARAMETER, FUNCTION_END), "done": (END,)}[self._phase]
        tag = next((t for t in expected if body.startswith(t)), None)
        if tag is None:
            if final or not any(t.startswith(body) for t in expected):
                self._phase = "bad"
            return self._phase == "bad"
        if tag in (FUNCTION, PARAMETER):
            name = _NAME.match(body, len(tag)).group()
            if not body.startswith(">", len(tag) + len(name)):
                self._phase = "bad" if final or len(body) > len(tag) + len(name) else self._phase
                return self._phase == "bad"
            if not name:
                self._phase = "bad"
                return True
            self._at += skip + len(tag) + len(name) + 1
            if tag == FUNCTION:
                self._name, self._phase = name, "params"
                self._stream(out, "")
            else:
                self._param, self._phase, self._seen = name, "value", 0
            return True
        self._at += skip + len(tag)
        if tag == FUNCTION_END:
            self._stream(out, json.dumps(self._params, ensure_ascii=False))
            self._phase = "done"
            return True
        self._phase = "text"  # END: the call is whole
        return True

    def _stream(self, out: DeltaMessage, arguments: str) -> None:
        if self._index is None:
            self._index = self.calls_made
        delta = self._progress(self._index, self._name, arguments)
        if delta is not None:
            out.tool_calls.append(delta)

    def _schema(self) -> dict[str, Any]:
        """The current function's parameter schemas, by name ({} for a function not given)."""
        for f in self.tools:
            if f.get("name") == self._name:
                properties = (f.get("parameters") or {}).get("properties")
                return properties if isinstance(properties, dict) else {}
        return {}



def parameter_value(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type says (vLLM's rules): "null" is None; strings,
    unknown parameters and values that do not convert stay text; integers, numbers (a whole
    number as an integer) and booleans; objects and arrays as JSON, or else (and any other
    type) as a Python literal that JSON can carry."""
    if value.lower() == "null":
        return None
    kind = str(schema["type"]).strip().lower() if isinstance(schema, dict) and "type" in schema else "string"
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if kind.startswith(("num", "float")):
            number = float(value)
            if not math.isfinite(number):
                return value
            return int(number) if number.is_integer() else number
    except ValueError:
        return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    structured = kind in ("object", "array", "arr") or kind.startswith(("dict", "list"))
    for load in (json.loads, ast.literal_eval) if structured else (ast.literal_eval,):
        try:
            loaded = load(value)
            json.dumps(loaded, allow_nan=False)  # only what JSON can carry
            return loaded
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
    return value
