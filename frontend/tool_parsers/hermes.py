"""Hermes-style calls, as Qwen2.5 and Qwen3 write them (vLLM's `hermes` parser):
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more, around plain text."""
from __future__ import annotations

from tritium.frontend.tool_parsers.base import DeltaMessage, ToolParser, call_name, held_back, started
from tritium.frontend.tool_parsers.json_scanner import CallScanner

_KEYS = ("arguments",)


class HermesToolParser(ToolParser):
    """Text outside the tags is content. A call streams from the moment its name and the
    opening brace of its arguments are written (`started`); a tagged body that is not a JSON
    call object (closed by its tag or by the end of the reply) stays text, and a streamed one
    that turns out so is abandoned (see ToolParser)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._gap = ""  # the space between text and the current call (text again if no call)
        self._pending = ""  # text seen but not yet given out (a possible tag, trailing space)
        self._call: CallScanner | None = None  # inside <tool_call>: its body
        self._call_index: int | None = None  # once the current call has started streaming

    def feed(self, text: str) -> DeltaMessage:
        self._pending += text
        out = DeltaMessage()
        while True:
            tag = self.END if self._call is not None else self.START
            at = self._pending.find(tag)
            if at < 0:
                break
            before, self._pending = self._pending[:at], self._pending[at + len(tag):]
            if self._call is None:
                out.content += before.rstrip()  # the space between text and a call is neither
                self._gap = before[len(before.rstrip()):]
                self._call, self._call_index = CallScanner(0, _KEYS), None
            else:
                self._call.feed(before)
                self._stream_call(out)
                self._close_call(out, closed=True)
        keep = held_back(self._pending, tag)
        ready, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        if self._call is None:
            # Trailing whitespace waits: after a call it is dropped, before one too.
            body = ready.rstrip()
            out.content += body
            self._pending = ready[len(body):] + self._pending
        else:
            self._call.feed(ready)
            self._stream_call(out)
        return out

    def finish(self) -> DeltaMessage:
        out = DeltaMessage()
        if self._call is not None:
            self._call.feed(self._pending)
            self._stream_call(out)
            self._close_call(out, closed=False)
        else:  # plain text keeps every character; after a call, trailing space is dropped
            out.content = self._pending if self.calls_made == 0 else self._pending.rstrip()
        self._pending = ""
        return out

    def _stream_call(self, out: DeltaMessage) -> None:
        scanner = self._call
        if not scanner.text.lstrip().startswith("{") or not scanner.calls:
            return
        call = scanner.calls[0]
        arguments = scanner.arguments(call)
        if not started(call.name, arguments):
            return
        if self._call_index is None:
            self._call_index = self.calls_made
        delta = self._progress(self._call_index, call.name, arguments)
        if delta is not None:
            out.tool_calls.append(delta)

    def _close_call(self, out: DeltaMessage, closed: bool) -> None:
        scanner, self._call = self._call, None
        name = call_name(scanner.text.strip(), _KEYS)
        text = self._gap + self.START + scanner.text + (self.END if closed else "")
        if self._call_index is not None:  # streamed already, up to its last character
            if name is None:  # cut off or malformed
                out.extend(self._abandon([self._call_index], text))
            return
        if name is None:  # not a call: it stays text
            out.content += text
            return
        arguments = scanner.arguments(scanner.calls[0])
        delta = self._progress(self.calls_made, name, arguments if arguments is not None else "{}")
        if delta is not None:
            out.tool_calls.append(delta)
