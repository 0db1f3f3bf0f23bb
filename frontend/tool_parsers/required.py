"""tool_choice "required" (as vLLM does it): guided decoding makes the model write a JSON array
of one or more `{"name": ..., "parameters": {...}}` objects, each naming one of the request's
functions with arguments that follow its schema; this parser turns that array into calls."""
from __future__ import annotations

import json
from typing import Any

from tritium.frontend.tool_parsers.base import DeltaMessage, ToolParser, call_name, is_call_array
from tritium.frontend.tool_parsers.json_scanner import CallScanner

_KEYS = ("parameters",)


def required_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of the call array for these function definitions (name, parameters)."""
    defs: dict[str, Any] = {}
    variants = []
    for f in functions:
        params = dict(f.get("parameters") or {"type": "object", "properties": {}})
        # $defs of every function's schema move up to the array's, where references find them.
        for key, schema in params.pop("$defs", {}).items():
            if defs.get(key, schema) != schema:
                raise ValueError(f"the tools define '$defs/{key}' differently; "
                                 "tool_choice 'required' needs one definition of each")
            defs[key] = schema
        variants.append({"type": "object", "properties": {
            "name": {"type": "string", "enum": [f["name"]]}, "parameters": params},
            "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if defs:
        schema["$defs"] = defs
    return schema


class RequiredToolParser(ToolParser):
    """Calls stream as written. A reply cut short (max_tokens) keeps the calls it wrote whole;
    the call it was writing is abandoned and its text is content (the whole reply, when no
    call was whole)."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._scanner = CallScanner(1, _KEYS)

    def feed(self, text: str) -> DeltaMessage:
        self._scanner.feed(text)
        return self._stream_calls(self._scanner, at_end=False)

    def finish(self) -> DeltaMessage:
        text, calls = self._scanner.text, self._scanner.calls
        if _is_call_array(text):
            return self._stream_calls(self._scanner, at_end=True)
        whole = 0
        while whole < len(calls) and calls[whole].end is not None and \
                call_name(text[calls[whole].start:calls[whole].end], _KEYS) is not None:
            whole += 1
        rest = text if whole == 0 else text[calls[whole].start:] if whole < len(calls) else ""
        return self._abandon(range(whole, self.calls_made), rest)


def _is_call_array(text: str) -> bool:
    return is_call_array(text, _KEYS)


class NamedToolParser(ToolParser):
    """A named tool_choice: guided decoding makes the whole reply the function's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self._arguments = name, ""

    def start(self) -> DeltaMessage:
        return DeltaMessage(tool_calls=[self._progress(0, self.name, "")])

    def feed(self, text: str) -> DeltaMessage:
        self._arguments += text
        delta = self._progress(0, self.name, self._arguments)
        return DeltaMessage(tool_calls=[delta] if delta is not None else [])

    def finish(self) -> DeltaMessage:
        try:
            whole = isinstance(json.loads(self._arguments), dict)
        except ValueError:
            whole = False
        # Cut short (max_tokens): not arguments an agent could run; the text is content.
        return DeltaMessage() if whole else self._abandon([0], self._arguments)
