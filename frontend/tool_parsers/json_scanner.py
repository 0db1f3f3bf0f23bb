"""Finds tool-call objects in JSON text while the model is still writing it: each object's
"name" once its string is complete, and where its arguments' value starts (and, once written,
ends), so that the arguments can be streamed as the model writes them, character for character."""
from __future__ import annotations

import json
from dataclasses import dataclass

_WHITESPACE = " \t\r\n"


@dataclass
class ScannedCall:
    """One call object seen so far; spans are offsets into the scanned text."""

    name: str | None = None
    arguments_start: int | None = None
    arguments_end: int | None = None
    closed: bool = False
    start: int = 0  # where its object opens
    end: int | None = None  # just past its closing brace


class CallScanner:
    """Call objects at nesting depth `base` of the text (0: the text is objects, as Hermes and
    Llama 3 write them; 1: a JSON array of objects, as tool_choice "required" makes the model
    write). It checks structure only as far as it needs to; json.loads decides validity."""

    def __init__(self, base: int, arguments_keys: tuple[str, ...]) -> None:
        self.base, self.arguments_keys = base, arguments_keys
        self.text = ""
        self.calls: list[ScannedCall] = []
        # An array of calls (base 1): just past its closing bracket, once written; the scanner
        # stops there, and what follows is left in `text`.
        self.end: int | None = None
        self._depth = 0
        self._in_string = self._escape = False
        # Inside a call: key, in_key, colon, value, in_value or after (a value).
        self._expect = "key"
        self._key: str | None = None
        self._token_start = 0  # where the current key or value began
        self._in_scalar = False

    def feed(self, text: str) -> None:
        start = len(self.text)
        self.text += text
        for i in range(start, len(self.text)):
            if self.end is not None:
                break
            self._step(i, self.text[i])

    def arguments(self, call: ScannedCall) -> str | None:
        """The call's arguments as written so far (None before they start)."""
        if call.arguments_start is None:
            return None
        end = call.arguments_end if call.arguments_end is not None else len(self.text)
        return self.text[call.arguments_start:end]

    def _step(self, i: int, c: str) -> None:
        member_depth = self.base + 1
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self._depth == member_depth:
                    self._string_closed(i)
            return
        if self._in_scalar and (c in _WHITESPACE or c in ",}]"):
            self._in_scalar = False
            self._value_closed(i)
        if self._depth == member_depth and self._expect in ("key", "value") and c not in _WHITESPACE \
                and c not in ",}":
            self._token_start = i
            self._expect = "in_" + self._expect
            if self._expect == "in_value":
                self._in_scalar = c not in '"{['
                call = self.calls[-1]
                if self._key in self.arguments_keys and call.arguments_start is None:
                    call.arguments_start = i
        if c == '"':
            self._in_string = True
        elif c in "{[":
            if c == "{" and self._depth == self.base:
                self.calls.append(ScannedCall(start=i))
                self._expect, self._key = "key", None
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == member_depth:
                self._value_closed(i + 1)
            elif self._depth == self.base and c == "}" and self.calls:
                self.calls[-1].closed, self.calls[-1].end = True, i + 1
            if self._depth == 0 and self.base == 1:
                self.end = i + 1
        elif self._depth == member_depth:
            if c == ":" and self._expect == "colon":
                self._expect = "value"
            elif c == ",":
                self._expect, self._key = "key", None

    def _string_closed(self, i: int) -> None:
        raw = self.text[self._token_start:i + 1]
        if self._expect == "in_key":
            self._key, self._expect = _loads(raw), "colon"
        elif self._expect == "in_value":
            self._value_closed(i + 1)

    def _value_closed(self, end: int) -> None:
        if self._expect != "in_value" or not self.calls:
            return
        self._expect = "after"
        call, raw = self.calls[-1], self.text[self._token_start:end]
        if self._key == "name":
            name = _loads(raw)
            call.name = name if isinstance(name, str) else None
        elif self._key in self.arguments_keys and call.arguments_start == self._token_start:
            call.arguments_end = end

def _loads(raw: str) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return None
