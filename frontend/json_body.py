"""A request body decoded as JSON, refused with a 400 naming the field when it is not JSON or
holds a string that is not Unicode text, and with a 413 when it is larger than MAX_BODY_BYTES."""
from __future__ import annotations

import json
import re
from typing import Any, AsyncIterator

from tritium.frontend.errors import bad_request
from tritium.frontend.limits import MAX_BODY_BYTES, body_too_large

# JSON's \uD800-\uDFFF escapes can leave a lone UTF-16 surrogate in a decoded string (a pair
# decodes to one character). Such a string cannot be encoded as UTF-8, so neither the tokenizer
# nor the gRPC request could take it. Raw UTF-8 bytes cannot encode a surrogate (json.loads
# refuses them), so only a body with such an escape is searched.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_body(chunks: AsyncIterator[bytes], content_length: str | None,
                    limit: int = MAX_BODY_BYTES) -> bytes:
    """The body's bytes, read piece by piece and refused once past `limit` (or at once, when
    its Content-Length says so), so that a larger one is never held whole."""
    if content_length is not None and content_length.isdigit() and int(content_length) > limit:
        raise body_too_large(limit)
    pieces, size = [], 0
    async for piece in chunks:
        size += len(piece)
        if size > limit:
            raise body_too_large(limit)
        pieces.append(piece)
    return b"".join(pieces)


def decode_json_body(raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    # ValueError also covers an integer of more digits than Python converts (4300).
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError among them
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
