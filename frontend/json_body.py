"""A request body decoded as JSON, refused with a 400 naming the field when it is not JSON or
holds a string that is not Unicode text."""
from __future__ import annotations

import json
import re
from typing import Any

from frontend.errors import bad_request

# JSON's \uD800-\uDFFF escapes can leave a lone UTF-16 surrogate in a decoded string (a pair
# decodes to one character). Such a string cannot be encoded as UTF-8, so neither the tokenizer
# nor the gRPC request could take it. Raw UTF-8 bytes cannot encode a surrogate (json.loads
# refuses them), so only a body with such an escape is searched.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def decode_json_body(raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request("the request body nests JSON arrays or objects too deeply") from None
    if _SURROGATE_ESCAPE.search(raw):
        found = _lone_surrogate(body, ())
        if found is not None:
            path, text = found
            param = ".".join(str(p) for p in path) or None
            match = _SURROGATE.search(text)
            assert match is not None
            what = (f"an unpaired UTF-16 surrogate (U+{ord(match.group()):04X} at index "
                    f"{match.start()}), which is not a Unicode character")
            raise bad_request(f"{param}: the string holds {what}" if param else f"the body holds {what}",
                              param)
    return body


def _lone_surrogate(value: Any, path: tuple) -> tuple[tuple, str] | None:
    """(where, the string) of the first string, or object key, holding a lone surrogate."""
    if isinstance(value, str):
        return (path, value) if _SURROGATE.search(value) else None
    if isinstance(value, list):
        items: Any = enumerate(value)
    elif isinstance(value, dict):
        for key in value:
            if _SURROGATE.search(key):
                return path, key
        items = value.items()
    else:
        return None
    for key, item in items:
        found = _lone_surrogate(item, (*path, key))
        if found is not None:
            return found
    return None
