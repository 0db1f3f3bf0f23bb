"""A response's output items, built from the parsed reply (frontend/chat_output.py's deltas) in
the order the model writes them: `reasoning`, `message` (one `output_text` part) and
`function_call` items; with the stream events that build them (the Responses API's event types).
The non-streamed reply runs the same builder over the whole text, so both carry the same items.

A call the tool parser abandons (it streamed, then turned out to be no call: cut off, or not the
format) ends "incomplete" and is left out of the response's output, as chat leaves it out of
the message; its text comes as a message, as chat gives it as content (streamed, after the
message of the text before the call, which was closed when the call began)."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from tritium.frontend.tool_parsers import DeltaMessage, ToolCallDelta

Event = dict[str, Any]  # a stream event without its sequence_number


@dataclass
class _Item:
    kind: str  # "reasoning", "message" or "function_call"
    id: str
    output_index: int
    text: str = ""  # the reasoning's or the message's text, or the call's arguments
    name: str | None = None
    call_id: str | None = None

    def as_dict(self, status: str, whole: bool = True) -> dict[str, Any]:
        """The item; `whole=False`: as it opens, before any text."""
        text = self.text if whole else ""
        if self.kind == "function_call":
            return {"id": self.id, "type": "function_call", "status": status, "call_id": self.call_id,
                    "name": self.name, "arguments": text}
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "status": status, "summary": [],
                    "content": [self.part(text)] if whole else []}
        return {"id": self.id, "type": "message", "status": status, "role": "assistant",
                "content": [self.part(text)] if whole else []}

    def part(self, text: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def where(self) -> dict[str, Any]:
        at = {"item_id": self.id, "output_index": self.output_index}
        return at if self.kind == "function_call" else {**at, "content_index": 0}


_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}
_TEXT_EVENT = {"reasoning": "response.reasoning_text", "message": "response.output_text",
               "function_call": "response.function_call_arguments"}


class OutputItems:
    """The items so far; `add` and `finish` return the events each step makes."""

    def __init__(self) -> None:
        self._done: list[tuple[str, dict[str, Any]]] = []  # (id, item) of finished items, in order
        self._started = 0  # items, the output_index of the next
        self._open: _Item | None = None
        self._calls: dict[int, _Item] = {}  # by the parser's call index
        self._abandoned: set[str] = set()  # ids of abandoned calls' items
        self._unseen: set[int] = set()  # calls abandoned in the step that began them: never shown
        # Whitespace-only text is held until text follows: before a call it is no message
        # (the chat reply drops it too), and after the last call it is dropped as well.
        self._spaces = ""

    @property
    def items(self) -> list[dict[str, Any]]:
        """The response's output: the finished items, less abandoned calls."""
        return [item for item_id, item in self._done if item_id not in self._abandoned]

    def add(self, delta: DeltaMessage, abandoned: set[int] | frozenset[int] = frozenset()) -> list[Event]:
        """`abandoned`: the tool parser's abandoned call indexes, after it made `delta`."""
        events = []
        for index in abandoned:
            item = self._calls.get(index)
            if item is None:
                self._unseen.add(index)
            elif item.id not in self._abandoned:
                self._abandoned.add(item.id)
                events += self._close("incomplete") if item is self._open else []
        if delta.reasoning_content:
            events += self._write("reasoning", delta.reasoning_content)
        if delta.content:
            text = self._spaces + delta.content
            if self._is_open("message") or text.strip():
                self._spaces = ""
                events += self._write("message", text)
            else:
                self._spaces = text
        for call in delta.tool_calls:
            events += self._call(call)
        return events

    def finish(self, status: str) -> list[Event]:
        """Closes the last item, `status` ("completed", or "incomplete" when the reply was cut)."""
        called = any(item.id not in self._abandoned for item in self._calls.values())
        events = self._write("message", self._spaces) if self._spaces and not called else []
        return events + self._close(status)

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open.kind == kind

    def _write(self, kind: str, text: str) -> list[Event]:
        events = [] if self._is_open(kind) else self._close("completed") + self._start(kind)
        self._open.text += text
        return events + [{"type": f"{_TEXT_EVENT[kind]}.delta", **self._open.where(), "delta": text,
                          **({"logprobs": []} if kind == "message" else {})}]

    def _call(self, delta: ToolCallDelta) -> list[Event]:
        if delta.index in self._unseen:
            return []
        events = []
        if delta.name is not None:
            events = self._close("completed") + self._start("function_call", delta.name, delta.id)
            self._calls[delta.index] = self._open
        assert self._calls[delta.index] is self._open, "a call's arguments grew after the next item began"
        if not delta.arguments:
            return events
        self._open.text += delta.arguments
        return events + [{"type": "response.function_call_arguments.delta", **self._open.where(),
                          "delta": delta.arguments}]

    def _start(self, kind: str, name: str | None = None, call_id: str | None = None) -> list[Event]:
        self._open = item = _Item(kind, f"{_PREFIX[kind]}_{uuid.uuid4().hex}", self._started,
                                  name=name, call_id=call_id)
        self._started += 1
        events = [{"type": "response.output_item.added", "output_index": item.output_index,
                   "item": item.as_dict("in_progress", whole=False)}]
        if kind != "function_call":
            events.append({"type": "response.content_part.added", **item.where(), "part": item.part("")})
        return events

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        done = item.as_dict(status)
        self._done.append((item.id, done))
        if item.kind == "function_call":
            events = [{"type": "response.function_call_arguments.done", **item.where(),
                       "arguments": item.text}]
        else:
            events = [{"type": f"{_TEXT_EVENT[item.kind]}.done", **item.where(), "text": item.text,
                       **({"logprobs": []} if item.kind == "message" else {})},
                      {"type": "response.content_part.done", **item.where(), "part": item.part(item.text)}]
        return events + [{"type": "response.output_item.done", "output_index": item.output_index,
                          "item": done}]
