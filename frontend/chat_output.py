"""The assistant's message out of the model's text: the reasoning parser takes the thinking out,
the tool parser the calls; which ones a request gets follows its tool_choice and the frontend's
flags (vLLM's --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from tritium.frontend.errors import bad_request
from tritium.frontend.protocol import ChatCompletionRequest
from tritium.frontend.reasoning import REASONING_PARSERS, ReasoningParser
from tritium.frontend.tool_parsers import (TOOL_PARSERS, DeltaMessage, NamedToolParser, RequiredToolParser,
                                   ToolParser)


@dataclass(frozen=True)
class ChatParsing:
    """The frontend's parsing flags."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    # vLLM's default (False): tool_choice "none" still shows the model its tools, as OpenAI does.
    exclude_tools_when_tool_choice_none: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not one of "
                             f"{', '.join(TOOL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {self.reasoning_parser!r} is not one of "
                             f"{', '.join(REASONING_PARSERS)}")

    def template_tools(self, req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
        """The tools the chat template gets (as vLLM: also under tool_choice "none", unless
        --exclude-tools-when-tool-choice-none)."""
        if not req.tools or (req.tool_choice == "none" and self.exclude_tools_when_tool_choice_none):
            return None
        return [t.model_dump(exclude_none=True) for t in req.tools]

    def adjust_sampling(self, req: ChatCompletionRequest, sampling: dict[str, Any]) -> None:
        """vLLM's adjust_request: a parser whose calls start with a special token ([TOOL_CALLS])
        needs special tokens left in the text."""
        parser = TOOL_PARSERS.get(self.tool_call_parser or "")
        if parser is not None and parser.keeps_special_tokens and req.tools and req.tool_choice != "none":
            sampling["skip_special_tokens"] = False

    def for_request(self, req: ChatCompletionRequest, prompt: str) -> Callable[[], "ChoiceOutput"]:
        """A maker of each choice's output parser; 400 for a tool_choice the flags do not allow."""
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        tools: Callable[[], ToolParser] | None = None
        if not isinstance(choice, str):
            tools = partial(NamedToolParser, choice.function.name)
        elif choice == "required":
            tools = RequiredToolParser
        elif choice == "auto" and req.tools:
            if not self.enable_auto_tool_choice:
                raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                                  "--tool-call-parser to be set", "tool_choice")
            functions = [t.function.model_dump(exclude_none=True) for t in req.tools]
            tools = partial(TOOL_PARSERS[self.tool_call_parser], functions)
        # Under guided decoding the reply is the constrained output from its first token: no thinking.
        reasoning = None if _guided(req, choice) else self.reasoning_parser

        def make() -> ChoiceOutput:
            return ChoiceOutput(ReasoningParser.create(reasoning, prompt) if reasoning else None,
                                tools() if tools is not None else None, req.include_reasoning)
        return make


def _guided(req: ChatCompletionRequest, choice: Any) -> bool:
    """Whether the request's output is constrained (a forced call, response_format, guided_*)."""
    if not isinstance(choice, str) or choice == "required":
        return True
    if req.response_format is not None and req.response_format.type != "text":
        return True
    given = [req.guided_json, req.guided_regex, req.guided_choice, req.guided_grammar]
    options = {"disable_any_whitespace", "backend"}  # structured_outputs' options, not a spec
    return any(v is not None for v in given) or any(k not in options for k in req.structured_outputs or {})


class ChoiceOutput:
    """One choice's text through the parsers, piece by piece; and its message as it grew."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None,
                 include_reasoning: bool = True) -> None:
        self.reasoning, self.tools = reasoning, tools
        # vLLM's include_reasoning=false: the thinking is still taken out of the content, and dropped.
        self.include_reasoning = include_reasoning
        self.message = DeltaMessage()

    def start(self) -> DeltaMessage:
        return self._keep(self.tools.start() if self.tools is not None else DeltaMessage())

    def feed(self, text: str) -> DeltaMessage:
        return self._keep(self._parse(text, final=False))

    def finish(self) -> DeltaMessage:
        return self._keep(self._parse("", final=True))

    def _parse(self, text: str, final: bool) -> DeltaMessage:
        out = DeltaMessage()
        if self.reasoning is not None:
            split = self.reasoning.feed(text)
            if final:
                split.extend(self.reasoning.finish())
            out.reasoning_content = split.reasoning_content if self.include_reasoning else ""
            text = split.content
        if self.tools is None:
            out.content = text
            return out
        out.extend(self.tools.feed(text))
        if final:
            out.extend(self.tools.finish())
        return out

    def _keep(self, delta: DeltaMessage) -> DeltaMessage:
        self.message.extend(delta)
        return delta

    @property
    def called(self) -> bool:
        """Whether the message has calls (whole ones: abandoned calls are not in it)."""
        return self.tools is not None and self.tools.calls_made > len(self.tools.abandoned)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """"tool_calls" when the model chose to call (auto, required), as vLLM and OpenAI say it;
        a call the request forced by name keeps the engine's reason, and so does a reply cut
        short ("length") or one that abandoned a streamed call: every call a client holds after
        "tool_calls" has arguments that parse."""
        if engine_reason in (None, "length") or not self.called or self.tools.abandoned \
                or isinstance(self.tools, NamedToolParser):
            return engine_reason
        return "tool_calls"

    def as_message(self) -> dict[str, Any]:
        """The whole message (non-streamed replies)."""
        m = self.message
        message: dict[str, Any] = {"role": "assistant", "content": m.content}
        if self.called:
            calls: dict[int, dict[str, Any]] = {}
            for d in m.tool_calls:
                if d.index in self.tools.abandoned:
                    continue
                if d.name is not None:
                    calls[d.index] = {"id": d.id, "type": "function",
                                      "function": {"name": d.name, "arguments": d.arguments}}
                else:
                    calls[d.index]["function"]["arguments"] += d.arguments
            message["content"] = m.content if m.content.strip() else None
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        if self.reasoning is not None:
            # vLLM's current name, and the older one that clients still read.
            message["reasoning"] = message["reasoning_content"] = m.reasoning_content or None
        return message


def delta_dict(delta: DeltaMessage) -> dict[str, Any]:
    """A streamed chunk's `delta`."""
    out: dict[str, Any] = {}
    if delta.reasoning_content:
        out["reasoning"] = out["reasoning_content"] = delta.reasoning_content
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = [d.as_dict() for d in delta.tool_calls]
    return out

