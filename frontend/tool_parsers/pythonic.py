"""Calls written as a Python list of calls (vLLM's `pythonic` parser; Llama 3.2, Llama 4,
ToolACE): the whole reply is `[get_weather(city="Paris"), get_time(zone="CET")]`. It is read
with Python's `ast`, never run: each call is a plain name with keyword arguments whose values
are literals (strings, numbers, booleans, None, lists, tuples and dicts of them); its
arguments are those values as a JSON object."""
from __future__ import annotations

import ast
import json

from tritium.frontend.tool_parsers.base import DeltaMessage, ToolParser


class PythonicToolParser(ToolParser):
    """Decides on the reply's first non-space character: `[` may be calls, anything else is
    text. Each call streams whole once its closing parenthesis is written (its arguments are
    re-written as JSON, so they cannot stream as the model writes them). A reply that is not a
    list of such calls by its end is text, and the calls it streamed are abandoned."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._text = ""
        self._mode = "undecided"  # then "text" or "calls"
        self._scan = 0  # the next character to look at
        self._open: list[str] = []  # the brackets open there
        self._quote: str | None = None  # the string it is in (its quote, maybe tripled)
        self._escape = False
        self._element = 0  # where the list's current element starts
        self._streaming = True  # until an element is no call, or the list has closed

    def feed(self, text: str) -> DeltaMessage:
        if self._mode == "text":
            return DeltaMessage(content=text)
        self._text += text
        if self._mode == "undecided":
            head = self._text.lstrip()
            if not head:
                return DeltaMessage()
            if not head.startswith("["):
                self._mode = "text"
                return DeltaMessage(content=self._text)
            self._mode, self._scan = "calls", len(self._text) - len(head)
        return self._stream(final=False)

    def finish(self) -> DeltaMessage:
        if self._mode == "text":
            return DeltaMessage()
        out = self._stream(final=True) if self._mode == "calls" else DeltaMessage()
        calls = parse_calls(self._text)
        if calls is None:
            return out.extend(self._abandon(range(self.calls_made), self._text))
        for index, (name, arguments) in enumerate(calls):  # those the scan did not see whole
            delta = self._progress(index, name, arguments)
            if delta is not None:
                out.tool_calls.append(delta)
        return out

    def _stream(self, final: bool) -> DeltaMessage:
        """Scans on (short of the last two characters, which may open a triple quote) and
        streams each call the list closes."""
        out = DeltaMessage()
        text = self._text
        stop = len(text) if final else len(text) - 2
        i = self._scan
        while i < stop and self._streaming:
            c = text[i]
            if self._quote is not None:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif text.startswith(self._quote, i):
                    i += len(self._quote) - 1
                    self._quote = None
            elif c in "'\"":
                self._quote = c * 3 if text.startswith(c * 3, i) else c
                i += len(self._quote) - 1
            elif c in "([{":
                self._open.append(c)
                if self._open == ["["]:
                    self._element = i + 1
            elif c in ")]}":
                if not self._open or "([{"[")]}".index(c)] != self._open.pop():
                    self._streaming = False  # not Python: the end decides
                elif c == ")" and self._open == ["["]:
                    self._call_closed(text[self._element:i + 1], out)
                elif not self._open:
                    self._streaming = False  # the list has closed
            elif c == "," and self._open == ["["]:
                self._element = i + 1
            i += 1
        self._scan = i
        return out

    def _call_closed(self, element: str, out: DeltaMessage) -> None:
        call = parse_call(element)
        if call is None:
            self._streaming = False
            return
        delta = self._progress(self.calls_made, *call)
        if delta is not None:
            out.tool_calls.append(delta)


def parse_calls(text: str) -> list[tuple[str, str]] | None:
    """The (name, JSON arguments) of each call of a reply that is a list of calls, else None."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = [_call(e) for e in tree.body.elts]
    return None if None in calls else calls


def parse_call(text: str) -> tuple[str, str] | None:
    try:
        return _call(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None


def _call(node: ast.expr) -> tuple[str, str] | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:
        return node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # sets, bytes, complex numbers, infinities
        return None
