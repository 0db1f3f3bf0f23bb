"""Llama 3.1/3.2's JSON calls (vLLM's `llama3_json` parser): the whole reply is one call object,
`{"name": ..., "parameters": {...}}` ("arguments" also taken), or several separated by `;`,
possibly after `<|python_tag|>`. Anything else is plain text."""
from __future__ import annotations

import json

from tritium.frontend.tool_parsers.base import DeltaMessage, ToolParser, call_name
from tritium.frontend.tool_parsers.json_scanner import CallScanner

_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    """Decides on the reply's first non-space character: `{` (after the optional tag) may be
    calls, streamed as they are written (`started`); anything else is text. A reply that does
    not parse as calls by its end is text, and the calls it streamed are abandoned (as vLLM,
    all or nothing)."""

    TAG = "<|python_tag|>"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._text = ""
        self._mode = "undecided"  # then "text" or "calls"
        self._scanner = CallScanner(0, _KEYS)

    def feed(self, text: str) -> DeltaMessage:
        if self._mode == "text":
            return DeltaMessage(content=text)
        self._text += text
        if self._mode == "undecided":
            head = self._text.lstrip()
            body = head[len(self.TAG):].lstrip() if head.startswith(self.TAG) else head
            if not body or (self.TAG.startswith(head) and not head.startswith(self.TAG)):
                return DeltaMessage()  # only space, or maybe the tag: wait
            if not body.startswith("{"):
                self._mode = "text"
                return DeltaMessage(content=self._text)
            self._mode = "calls"
            self._scanner.feed(body)
        else:
            self._scanner.feed(text)
        return self._stream_calls(self._scanner, at_end=False)

    def finish(self) -> DeltaMessage:
        if self._mode == "text":
            return DeltaMessage()
        if self._mode == "undecided" or not _all_calls(self._scanner.text):
            return self._abandon(range(self.calls_made), self._text)  # space only, cut off, no calls
        return self._stream_calls(self._scanner, at_end=True)


def _all_calls(text: str) -> bool:
    """Whether `text` is one or more call objects separated by semicolons."""
    decoder, at, count = json.JSONDecoder(), 0, 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return count > 0
        if count:
            if text[at] != ";":
                return False
            at += 1
            while at < len(text) and text[at].isspace():
                at += 1
        try:
            _, end = decoder.raw_decode(text, at)
        except ValueError:
            return False
        if call_name(text[at:end], _KEYS) is None:
            return False
        at, count = end, count + 1
