"""The prefix cache's block hashes: a chained SHA-256 of the parent block's hash and this block's
tokens, whose root hashes the request's LoRA adapter and cache_salt (see block_manager.py)."""
from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from typing import Sequence as Seq


# The canonical encoding, versioned: change the tag whenever the encoding changes.
_ROOT_TAG = b"tritium-prefix-cache-v1\x00"
_TOKEN_ARRAY = "I"  # uint32: every vocabulary fits
assert array(_TOKEN_ARRAY).itemsize == 4
_BIG_ENDIAN = sys.byteorder == "big"


def _encode_field(value: str | None) -> bytes:
    """None -> 0x00; a string -> 0x01, its UTF-8 length (uint32 LE), its UTF-8 bytes."""
    if value is None:
        return b"\x00"
    data = value.encode("utf-8")
    return b"\x01" + struct.pack("<I", len(data)) + data


def root_block_hash(lora_name: str | None = None, cache_salt: str | None = None) -> bytes:
    """The parent hash of a sequence's first block: SHA-256 of the tag, then the LoRA adapter's
    name and the cache_salt, each as `_encode_field` writes it. Keys and values depend on the
    adapter; the salt keeps tenants that use different salts from ever sharing a block."""
    return hashlib.sha256(_ROOT_TAG + _encode_field(lora_name) + _encode_field(cache_salt)).digest()


NONE_HASH = root_block_hash()  # the root of a base-model sequence without a salt


def hash_block_tokens(parent_hash: bytes | None, token_ids: Seq[int]) -> bytes:
    """SHA-256 of the parent's 32-byte digest (None: NONE_HASH) followed by the block's token
    ids as uint32 little-endian."""
    tokens = array(_TOKEN_ARRAY, token_ids)
    if _BIG_ENDIAN:
        tokens.byteswap()
    return hashlib.sha256((parent_hash or NONE_HASH) + tokens.tobytes()).digest()


def hash_prompt_blocks(root: bytes, token_ids: list[int], block_size: int) -> list[bytes]:
    """The chained hashes of the prompt's full blocks (computed by the input processor, on the
    caller's thread, so that the engine's step loop does not hash prompts)."""
    num_full = len(token_ids) // block_size
    tokens = array(_TOKEN_ARRAY, token_ids[:num_full * block_size])  # encoded once, sliced per block
    if _BIG_ENDIAN:
        tokens.byteswap()
    data = memoryview(tokens.tobytes())
    step = 4 * block_size
    sha256 = hashlib.sha256
    hashes: list[bytes] = []
    parent = root
    for start in range(0, num_full * step, step):
        h = sha256(parent)
        h.update(data[start:start + step])
        parent = h.digest()
        hashes.append(parent)
    return hashes
