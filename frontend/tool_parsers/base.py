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
    from tritium.frontend.tool_parsers.json_scanner import CallScanner


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
    """Turns the model's text into content and tool calls, incrementally.

    A call that began streaming and then turns out to be no call (cut off, or not the format)
    is `abandoned`: its deltas were sent and cannot be taken back, so its text comes as content
    too, the non-streamed message leaves it out, and finish_reason is not "tool_calls"."""

    keeps_special_tokens = False  # its calls start with a special token (see ChatParsing.adjust_sampling)

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []  # the request's function definitions (name, parameters)
        self._sent: list[tuple[str, str]] = []  # per call started: (name, arguments sent)
        self.abandoned: set[int] = set()

    def new_call_id(self) -> str:
        return tool_call_id()

    def start(self) -> DeltaMessage:
        """What the reply opens with, before any text (a named function's call)."""
        return DeltaMessage()

    @abstractmethod
    def feed(self, text: str) -> DeltaMessage: ...

    @abstractmethod
    def finish(self) -> DeltaMessage: ...

    @property
    def calls_made(self) -> int:
        """Calls started (streamed), abandoned ones included."""
        return len(self._sent)

    def _abandon(self, indexes: range | list[int], text: str) -> DeltaMessage:
        self.abandoned.update(indexes)
        return DeltaMessage(content=text)

    def _progress(self, index: int, name: str, arguments: str) -> ToolCallDelta | None:
        """The delta that brings call `index` (numbered in the order calls start) to this name
        and arguments so far; the arguments only ever grow, as the model writes them."""
        if index == len(self._sent):
            self._sent.append((name, arguments))
            return ToolCallDelta(index, self.new_call_id(), name, arguments)
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


class TaggedToolParser(ToolParser):
    """A parser whose calls each begin at a `tag` among plain text (Mistral's [TOOL_CALLS],
    Qwen3-Coder's <tool_call>): the text between calls is read here, the calls by `_step`."""

    tag: str

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._text = ""  # the reply so far
        self._at = 0  # where parsing goes on
        self._phase = "text"  # else where in a call (each parser's own phases)
        self._call_at = 0  # where the current call's tag starts
        self._gap = ""  # the space before it (text again if no call follows)

    def feed(self, text: str) -> DeltaMessage:
        self._text += text
        return self._parse(final=False)

    def finish(self) -> DeltaMessage:
        return self._parse(final=True)

    def _parse(self, final: bool) -> DeltaMessage:
        out = DeltaMessage()
        while True:
            if self._phase == "text":
                content, gap, self._at, found = text_part(self._text, self._at, self.tag, final,
                                                          after_calls=self.calls_made > 0)
                out.content += content
                if found is None:
                    return out
                self._call_at, self._gap = found, gap
                self._begin()
            elif not self._step(out, final):
                return out

    def _call_text(self, end: int) -> str:
        """The current call's text up to `end`, with the space before it: content after all."""
        return self._gap + self._text[self._call_at:end]

    @abstractmethod
    def _begin(self) -> None:
        """A call's tag was read (parsing goes on just past it): the parser's first phase."""

    @abstractmethod
    def _step(self, out: DeltaMessage, final: bool) -> bool:
        """One move inside the current call, its deltas added to `out`; False when it waits
        for more text."""


def started(name: str | None, arguments: str | None) -> bool:
    """Whether a call streams: from the moment its name and the opening brace of its arguments
    are written (as vLLM streams calls), its arguments as the text the model writes for them.
    One that does not end as a whole call is then abandoned (see ToolParser)."""
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


def is_call_array(text: str, arguments_keys: tuple[str, ...]) -> bool:
    """Whether `text` is a JSON array of one or more call objects."""
    try:
        calls = json.loads(text)
    except ValueError:
        return False
    return isinstance(calls, list) and bool(calls) and \
        all(call_name(json.dumps(c), arguments_keys) is not None for c in calls)


def text_part(text: str, at: int, tag: str, final: bool, after_calls: bool) -> tuple[str, str, int, int | None]:
    """Plain text from `at` up to a call's start `tag`: (the content ready to give out, the
    space before the tag, where parsing goes on, where the tag starts or None). What could be
    the start of the tag waits, and so does trailing space: between text and a call it is
    neither (given back if the call turns out to be text), after the last call it is dropped."""
    found = text.find(tag, at)
    if found >= 0:
        body = text[at:found].rstrip()
        return body, text[at + len(body):found], found + len(tag), found
    if final:
        rest = text[at:]
        return (rest.rstrip() if after_calls else rest), "", len(text), None
    body = text[at:len(text) - held_back(text[at:], tag)].rstrip()
    return body, "", at + len(body), None


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (kept until the
    next piece says whether the tag follows)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
