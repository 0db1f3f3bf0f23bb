"""Reasoning parsers (vLLM's `--reasoning-parser` names): the thinking a model writes between
`<think>` and `</think>` goes to the message's `reasoning_content`, the rest to `content`.

- `qwen3`: Qwen3 writes `<think>...</think>` itself, or its template opens `<think>` in the
  prompt (then the reply starts inside the thinking). A reply without the tags is all content
  (Qwen3 with enable_thinking=False: its template closes an empty thinking in the prompt).
- `deepseek_r1`: the reply starts inside the thinking (DeepSeek-R1's template opens `<think>` in
  the prompt; a `<think>` the model writes anyway is dropped); with no `</think>` all is thinking.

Fed piece by piece, like the tool parsers: a tag split over pieces is held until it is whole."""
from __future__ import annotations

from tritium.frontend.tool_parsers.base import DeltaMessage, held_back

START, END = "<think>", "</think>"


class ReasoningParser:
    """One reply's split into reasoning and content."""

    def __init__(self, thinking: bool) -> None:
        # "open": content until a <think> comes; "thinking"; "done": content from here on.
        self._state = "thinking" if thinking else "open"
        self._fresh = True  # nothing given out yet: a leading <think> is a tag, not text
        self._pending = ""

    @classmethod
    def create(cls, name: str, prompt: str) -> "ReasoningParser":
        if name == "deepseek_r1":
            return cls(thinking=True)
        assert name == "qwen3", name
        return cls(thinking=_opens_thinking(prompt))

    def feed(self, text: str) -> DeltaMessage:
        self._pending += text
        out = DeltaMessage()
        while self._state != "done":
            tag = END if self._state == "thinking" else START
            if self._fresh and self._state == "thinking":
                head = self._pending.lstrip()
                if START.startswith(head):  # empty, or maybe the start of <think>
                    return out
                if head.startswith(START):
                    self._pending = head[len(START):]
                self._fresh = False
            at = self._pending.find(tag)
            if at < 0:
                keep = held_back(self._pending, tag)
                self._give(out, self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                return out
            self._give(out, self._pending[:at])
            self._pending = self._pending[at + len(tag):]
            self._state = "thinking" if self._state == "open" else "done"
            self._fresh = False
        out.content += self._pending
        self._pending = ""
        return out

    def finish(self) -> DeltaMessage:
        out = DeltaMessage()
        self._give(out, self._pending)
        self._pending = ""
        return out

    def _give(self, out: DeltaMessage, text: str) -> None:
        if not text:
            return
        self._fresh = False
        if self._state == "thinking":
            out.reasoning_content += text
        else:
            out.content += text


REASONING_PARSERS = ("qwen3", "deepseek_r1")


def _opens_thinking(prompt: str) -> bool:
    """Whether the templated prompt leaves a <think> open (the reply then starts thinking)."""
    return prompt.rfind(START) > prompt.rfind(END)
