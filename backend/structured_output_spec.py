"""The shape of a request's `structured_outputs` (vLLM's guided decoding spec), checked where a
SamplingParams is made. Compiling its content is the engine's (engine/structured_output.py)."""
from __future__ import annotations

import json
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")
_OPTIONS = ("disable_any_whitespace", "backend")
_BACKENDS = (None, "auto", "xgrammar")


def check_spec(spec: Any) -> dict[str, Any]:
    """The spec's shape (not yet its content: that is `compile`'s), normalized: exactly one
    kind, with its value, plus the options. Raises ValueError with the problem."""
    if not isinstance(spec, dict):
        raise ValueError(f"structured_outputs must be an object with one of {', '.join(KINDS)}, "
                         f"got {spec!r}.")
    unknown = sorted(k for k in spec if k not in KINDS and k not in _OPTIONS)
    if unknown:
        raise ValueError(f"structured_outputs: unknown field '{unknown[0]}'. Valid fields: "
                         f"{', '.join(KINDS + _OPTIONS)}.")
    given = [k for k in KINDS if spec.get(k) is not None and spec.get(k) is not False]
    if len(given) != 1:
        raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; "
                         f"got {', '.join(given) if given else 'none'}.")
    kind = given[0]
    value = spec[kind]
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs: json is not a valid JSON schema: {e}.") from None
        if not isinstance(value, (dict, bool)):
            raise ValueError(f"structured_outputs: json must be a JSON schema (an object), got {value!r}.")
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs: {kind} must be a non-empty string, got {value!r}.")
    elif kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise ValueError(f"structured_outputs: choice must be a non-empty list of non-empty "
                             f"strings, got {value!r}.")
    elif value is not True:
        raise ValueError(f"structured_outputs: json_object must be true, got {value!r}.")
    whitespace = spec.get("disable_any_whitespace", False)
    if not isinstance(whitespace, bool):
        raise ValueError(f"structured_outputs: disable_any_whitespace must be a boolean, got {whitespace!r}.")
    if spec.get("backend") not in _BACKENDS:
        raise ValueError(f"structured_outputs: backend {spec['backend']!r} is not available; "
                         f"the engine uses xgrammar ('auto' or 'xgrammar').")
    return {kind: value, "disable_any_whitespace": whitespace}
