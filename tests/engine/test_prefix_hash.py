"""Prefix-cache keys: SHA-256 over a canonical encoding, rooted in the LoRA adapter and cache_salt."""
from __future__ import annotations

import hashlib
import struct

import pytest

from tritium import EngineArgs, LLMEngine, SamplingParams
from tritium.core.block_manager import (NONE_HASH, BlockManager, hash_block_tokens, hash_prompt_blocks,
                                          root_block_hash)
from tritium.core.sequence import Sequence

TAG = b"tritium-prefix-cache-v1\x00"


def test_canonical_encoding_has_known_digests():
    # Root: tag, then the adapter and the salt (0x00: none; 0x01, uint32 LE length, UTF-8 bytes).
    assert NONE_HASH == hashlib.sha256(TAG + b"\x00" + b"\x00").digest()
    assert NONE_HASH.hex() == "87dcdf5bb53b7128edf65dba2bd245783a038b2ff3b316bce1c2e68b0db8acea"
    salted = root_block_hash(cache_salt="abc")
    assert salted == hashlib.sha256(TAG + b"\x00" + b"\x01" + struct.pack("<I", 3) + b"abc").digest()
    assert salted.hex() == "60d708fff9bf57d3cc26f1b7c741aa4df5c180f54c6db2b8bbba8b5b56d36736"
    # A block: the parent's 32 bytes, then the tokens as uint32 little-endian.
    block = hash_block_tokens(NONE_HASH, [1, 2, 3, 4])
    assert block == hashlib.sha256(NONE_HASH + bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0])).digest()
    assert block.hex() == "2c4a44f5c56c66802f02f3cefb165cdab97f799a8eb7f4fe383b6c7a216e4cdd"
    assert hash_block_tokens(None, (1, 2, 3, 4)) == block  # None is the unsalted root
    assert hash_prompt_blocks(NONE_HASH, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [
        block, hash_block_tokens(block, [5, 6, 7, 8])]


def test_roots_of_adapters_and_salts_all_differ():
    roots = [root_block_hash(), root_block_hash("a"), root_block_hash(None, "a"), root_block_hash("a", "a"),
             root_block_hash(""), root_block_hash(None, ""), root_block_hash("ab", None),
             root_block_hash("a", "b"), root_block_hash("ab", "")]
    assert len(set(roots)) == len(roots)
    assert root_block_hash("x", "y") == root_block_hash("x", "y")


def _admit(bm: BlockManager, s: Sequence) -> int:
    hit = bm.get_computed_blocks(s)
    assert bm.allocate_slots(s, s.num_tokens - hit.num_tokens, hit)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)
    return hit.num_tokens


def _seq(tokens: list[int], rid: str, salt: str | None) -> Sequence:
    s = Sequence(rid, tokens, len(tokens), SamplingParams(cache_salt=salt))
    s.block_hash_root = root_block_hash(None, salt)
    return s


def test_equal_blocks_with_different_salts_share_no_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(10, 23))  # 3 full blocks and one token
    a = _seq(tokens, "a", "tenant-1")
    assert _admit(bm, a) == 0
    b = _seq(tokens, "b", "tenant-2")
    assert _admit(bm, b) == 0
    plain = _seq(tokens, "p", None)
    assert _admit(bm, plain) == 0
    assert not set(a.block_table) & set(b.block_table)
    assert not set(plain.block_table) & (set(a.block_table) | set(b.block_table))
    assert len(bm.cached_blocks) == 9
    same = _seq(tokens, "c", "tenant-1")
    assert _admit(bm, same) == 12
    assert same.block_table[:3] == a.block_table[:3]
    assert [bm.blocks[i].ref_cnt for i in a.block_table] == [2, 2, 2, 1]
    bm.check_integrity([a, b, plain, same])


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine(EngineArgs(model=llama_dir, block_size=16, max_model_len=128))


def _run(engine: LLMEngine, rid: str, prompt: list[int], salt: str | None) -> int:
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, cache_salt=salt))
    cached = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                cached = out.num_cached_tokens
    return cached


def test_cache_salt_through_the_engine(engine):
    prompt = list(range(5, 45))  # 40 tokens: two full blocks can be hit
    assert _run(engine, "t1-a", prompt, "tenant-1") == 0
    assert _run(engine, "t2-a", prompt, "tenant-2") == 0
    assert _run(engine, "plain", prompt, None) == 0
    assert _run(engine, "t1-b", prompt, "tenant-1") == 32
    assert _run(engine, "t2-b", prompt, "tenant-2") == 32
    assert _run(engine, "plain-b", prompt, None) == 32
    bm = engine.block_manager
    assert bm.usage == 0.0
    bm.check_integrity([])
    # The salt travels through from_dict, as the Triton and OpenAI paths send it.
    assert SamplingParams.from_dict({"cache_salt": "tenant-1"}).cache_salt == "tenant-1"
    with pytest.raises(ValueError, match=r"^sampling parameter 'cache_salt' must be a string, got 3\.$"):
        SamplingParams.from_dict({"cache_salt": 3})
    with pytest.raises(ValueError, match=r"^cache_salt must be a non-empty string if provided, got ''\.$"):
        SamplingParams(cache_salt="")


def test_prompt_hashes_are_made_by_the_input_processor(engine):
    req = engine.make_request("h", list(range(5, 45)), SamplingParams(cache_salt="s"))
    root = root_block_hash(None, "s")
    assert req.block_hashes == hash_prompt_blocks(root, list(range(5, 45)), 16)
    assert len(req.block_hashes) == 2
