"""Tool-call parsers (vLLM's `--tool-call-parser` names) and the parsers for tool_choice
"required" and a named function."""
from __future__ import annotations

from tritium.frontend.tool_parsers.base import DeltaMessage, ToolCallDelta, ToolParser
from tritium.frontend.tool_parsers.hermes import HermesToolParser
from tritium.frontend.tool_parsers.llama3_json import Llama3JsonToolParser
from tritium.frontend.tool_parsers.mistral import MistralToolParser
from tritium.frontend.tool_parsers.pythonic import PythonicToolParser
from tritium.frontend.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from tritium.frontend.tool_parsers.required import NamedToolParser, RequiredToolParser, required_schema

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
}

__all__ = ["DeltaMessage", "ToolCallDelta", "ToolParser", "TOOL_PARSERS", "HermesToolParser",
           "Llama3JsonToolParser", "MistralToolParser", "PythonicToolParser", "Qwen3CoderToolParser",
           "NamedToolParser", "RequiredToolParser", "required_schema"]
