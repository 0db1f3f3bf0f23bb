"""What every tool-call parser shares: the deltas it produces and the bookkeeping that turns a
call's growing name and arguments into OpenAI's streamed tool-call deltas.

A parser is fed the model's text piece by piece (`feed`) and told when it ends (`finish`); it
returns, each time, only what is new. The non-streamed reply runs the same parser over the
whole text, so both replies carry exactly the same calls and content, however the text was cut."""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from frontend.tool_parsers.json_scanner import CallScanner


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCallDelta:
    """A piece of call `index`: its id, type and name come once, with its first arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_dict(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, **function}
            return {"index": self.index, "id": self.id, "type": "function", "function": function}
        return {"index": self.index, "function": function}


@dataclass
class DeltaMessage:
    """What one step added to the assistant's message."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)

    def extend(self, other: "DeltaMessage") -> "DeltaMessage":
        self.content += other.content
        self.reasoning_content += other.reasoning_content
        self.tool_calls += other.tool_calls
        return self


class ToolParser(ABC):
    """Turns the model's text into content and tool calls, incrementally."""

    def __init__(self) -> None:
        self._sent: list[tuple[str, str]] = []  # per call started: (name, arguments sent)

    def start(self) -> DeltaMessage:
        """What the reply opens with, before any text (a named function's call)."""
        return DeltaMessage()

    @abstractmethod
    def feed(self, text: str) -> DeltaMessage: ...

    @abstractmethod
    def finish(self) -> DeltaMessage: ...

    @property
    def calls_made(self) -> int:
        return len(self._sent)

    def _progress(self, index: int, name: str, arguments: str) -> ToolCallDelta | None:
        """The delta that brings call `index` (numbered in the order calls start) to this name
        and arguments so far; the arguments only ever grow, as the model writes them."""
        if index == len(self._sent):
            self._sent.append((name, arguments))
            return ToolCallDelta(index, tool_call_id(), name, arguments)
        sent_name, sent = self._sent[index]
        assert arguments.startswith(sent) and name == sent_name, "a call's streamed text changed"
        self._sent[index] = (name, arguments)
        return ToolCallDelta(index, arguments=arguments[len(sent):]) if arguments != sent else None

    def _stream_calls(self, scanner: "CallScanner", at_end: bool) -> DeltaMessage:
        """Deltas for the calls `scanner` has seen, in order (see `started`); at the end of a
        reply that parsed as calls, also those whose arguments were left out."""
        out = DeltaMessage()
        for index, call in enumerate(scanner.calls):
            arguments = scanner.arguments(call)
            if not started(call.name, arguments) and not (at_end and call.name):
                break  # calls start in order
            delta = self._progress(index, call.name, arguments if arguments is not None else "{}")
            if delta is not None:
                out.tool_calls.append(delta)
        return out


def started(name: str | None, arguments: str | None) -> bool:
    """Whether a call streams: from the moment its name and the opening brace of its arguments
    are written (as vLLM streams calls). From then on it is a call, whose arguments are the text
    the model writes for them; a reply that breaks off before that point stays text."""
    return bool(name) and arguments is not None and arguments.startswith("{")


def call_name(text: str, arguments_keys: tuple[str, ...]) -> str | None:
    """The function name of one call object's text, or None when it is not a call: not JSON,
    not an object, no name, or arguments (under one of `arguments_keys`) that are not an object."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    given = [k for k in arguments_keys if k in obj]
    if len(given) > 1 or (given and not isinstance(obj[given[0]], dict)):
        return None
    return obj["name"]


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (kept until the
    next piece says whether the tag follows)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
