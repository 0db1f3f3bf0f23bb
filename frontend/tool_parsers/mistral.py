"""Mistral's calls (vLLM's `mistral` parser), after text, each behind the `[TOOL_CALLS]` token:
a JSON array of `{"name": ..., "arguments": {...}}` objects (tokenizers before v11), or one call
per token as the name and then its arguments object (v11 on: `[TOOL_CALLS]name{...}`, and
`[TOOL_CALLS]name[ARGS]{...}` as newer chat templates write it)."""
from __future__ import annotations

import json
import random
import re
import string

from tritium.frontend.tool_parsers.base import DeltaMessage, TaggedToolParser, is_call_array
from tritium.frontend.tool_parsers.json_scanner import CallScanner

TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
_KEYS = ("arguments",)
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


class MistralToolParser(TaggedToolParser):
    """Arguments stream as the model writes them. A call that does not end as a JSON object of
    arguments (an array that is not one of calls) is text, abandoned once streamed. The tag is
    a special token: the request keeps special tokens in its text, as vLLM's adjust_request."""

    tag = TAG
    keeps_special_tokens = True

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)  # phases after a tag: start, array, name, args
        self._first = 0  # the index of the current tag's (first) call
        self._array: CallScanner | None = None
        self._fed = 0  # how far the array's scanner has the text
        self._name = ""
        self._args_at = 0
        self._object = _ObjectEnd()

    def new_call_id(self) -> str:
        # Mistral's chat templates take ids of 9 letters and digits only (as vLLM's MistralToolCall).
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def _begin(self) -> None:
        self._phase, self._first = "start", self.calls_made

    def _step(self, out: DeltaMessage, final: bool) -> bool:
        rest = self._text[self._at:]
        body = rest.lstrip()
        if self._phase == "start":
            if not body:
                return self._text_again(out, len(self._text)) if final else False
            self._at += len(rest) - len(body)
            if body.startswith("[") and self.calls_made == 0:  # before v11: one array of calls
                self._phase, self._array, self._fed = "array", CallScanner(1, _KEYS), self._at
            else:
                self._phase = "name"
            return True
        if self._phase == "array":
            self._array.feed(self._text[self._fed:])
            self._fed = len(self._text)
            out.extend(self._stream_calls(self._array, at_end=False))
            if self._array.end is None:
                return self._text_again(out, len(self._text)) if final else False
            end = self._at + self._array.end
            if not is_call_array(self._text[self._at:end], _KEYS):
                return self._text_again(out, end)
            out.extend(self._stream_calls(self._array, at_end=True))
            self._at, self._phase = end, "text"
            return True
        if self._phase == "name":
            name = _NAME.match(rest).group()
            after = rest[len(name):]
            marked = after.startswith(ARGS)
            after = after[len(ARGS):] if marked else after
            if name and after.startswith("{"):
                self._name, self._args_at = name, len(self._text) - len(after)
                self._phase, self._object = "args", _ObjectEnd()
                return True
            if not final and (not after or not marked and ARGS.startswith(after)):
                return False  # the name or its [ARGS] goes on
            return self._text_again(out, self._at)  # no call's name: text from the tag on
        # args: the object streams as the model writes it, up to its closing brace
        end = self._object.feed(self._text, self._args_at)
        arguments = self._text[self._args_at:len(self._text) if end is None else end]
        delta = self._progress(self._first, self._name, arguments)
        if delta is not None:
            out.tool_calls.append(delta)
        if end is None:
            return self._text_again(out, len(self._text)) if final else False
        if not _is_object(arguments):
            return self._text_again(out, end)
        self._at, self._phase = end, "text"
        return True

    def _text_again(self, out: DeltaMessage, end: int) -> bool:
        """The current tag's call(s), up to `end`, are text after all (abandoned if streamed)."""
        out.extend(self._abandon(range(self._first, self.calls_made), self._call_text(end)))
        self._at, self._phase = end, "text"
        return True


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class _ObjectEnd:
    """Where a JSON object that the text holds from some offset closes, found as it is written
    (strings and escapes followed, so that braces inside strings do not count)."""

    def __init__(self) -> None:
        self._scanned = 0
        self._depth = 0
        self._in_string = self._escape = False

    def feed(self, text: str, start: int) -> int | None:
        """Just past the object's closing brace, once written; else None."""
        for i in range(start + self._scanned, len(text)):
            c = text[i]
            self._scanned += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None
