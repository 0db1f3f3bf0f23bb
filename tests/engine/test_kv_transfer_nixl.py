"""NIXL block transfers between two engines' paged KV caches (the transfer under disaggregated
prefill): a reader pulls chosen blocks of a peer's [2, layers, blocks, ...] cache into its own
blocks exactly, in one process and across two, and the peer is told when the read is done;
mismatched caches and block ids out of range are clear errors."""
from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from tritium.kv_transfer.nixl_blocks import NixlBlockTransfer

LAYERS, BLOCK, HEADS, DIM = 3, 4, 2, 8


def _cache(num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, LAYERS, num_blocks, BLOCK, HEADS, DIM, generator=g).to(torch.bfloat16)


def _wait(transfer: NixlBlockTransfer, handle) -> None:
    deadline = time.monotonic() + 30
    while not transfer.poll(handle):
        assert time.monotonic() < deadline, "the read did not finish"


def _notifications(transfer: NixlBlockTransfer) -> list[bytes]:
    deadline, got = time.monotonic() + 30, []
    while not got and time.monotonic() < deadline:
        got = transfer.notifications()
    return got


def test_a_reader_pulls_the_peers_blocks_exactly_and_the_peer_hears_of_it():
    prefill, decode = _cache(12, 1), _cache(6, 2)
    before = decode.clone()
    producer, consumer = NixlBlockTransfer(prefill), NixlBlockTransfer(decode)
    peer = consumer.add_peer(producer.metadata())
    _wait(consumer, consumer.read(peer, [5, 2, 9], [0, 3, 1], b"request-7"))
    for src, dst in ((5, 0), (2, 3), (9, 1)):
        assert torch.equal(decode[:, :, dst], prefill[:, :, src])
    for untouched in (2, 4, 5):
        assert torch.equal(decode[:, :, untouched], before[:, :, untouched])
    assert _notifications(producer) == [b"request-7"]
    consumer.close()
    producer.close()


def test_runs_of_adjacent_blocks_read_exactly_beside_scattered_ones():
    """Runs of consecutive blocks on both sides are adjacent in each (K or V, layer) plane, which
    NIXL merges into one operation; a run that is consecutive on one side only, and blocks that
    break a run, must land where they were asked to."""
    prefill, decode = _cache(16, 4), _cache(12, 5)
    before = decode.clone()
    producer, consumer = NixlBlockTransfer(prefill), NixlBlockTransfer(decode)
    peer = consumer.add_peer(producer.metadata())
    remote = [3, 4, 5, 6, 10, 11, 12, 0, 1]
    local = [0, 1, 2, 3, 7, 8, 5, 10, 9]  # 12 -> 5 and 1 -> 9 break the runs on the local side
    _wait(consumer, consumer.read(peer, remote, local, b"runs"))
    for src, dst in zip(remote, local):
        assert torch.equal(decode[:, :, dst], prefill[:, :, src]), (src, dst)
    for untouched in sorted(set(range(12)) - set(local)):
        assert torch.equal(decode[:, :, untouched], before[:, :, untouched])
    consumer.close()
    producer.close()


def test_a_read_of_many_regions_split_across_ucx_workers_is_exact():
    """Past NIXL's split size (a thousand regions) a read is cut into chunks, one per UCX
    worker of `num_threads`: a long prompt's read on a GPU."""
    layers, blocks = 8, 160
    g = torch.Generator().manual_seed(3)
    prefill = torch.randn(2, layers, blocks, 2, 1, 4, generator=g)
    decode = torch.zeros(2, layers, blocks // 2, 2, 1, 4)
    producer, consumer = NixlBlockTransfer(prefill, num_threads=2), NixlBlockTransfer(decode, num_threads=2)
    peer = consumer.add_peer(producer.metadata())
    remote = list(range(blocks - 1, 0, -2))  # (nothing adjacent on both sides: no region merges)
    _wait(consumer, consumer.read(peer, remote, list(range(blocks // 2)), b"long"))
    assert torch.equal(decode, prefill[:, :, remote])
    assert _notifications(producer) == [b"long"]
    consumer.close()
    producer.close()


def test_mismatched_caches_and_bad_block_ids_are_refused():
    producer = NixlBlockTransfer(_cache(4, 1))
    other = NixlBlockTransfer(torch.zeros(2, LAYERS + 1, 4, BLOCK, HEADS, DIM, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"^the peer's KV cache has 3 layers of 128-byte blocks, this one 4 of "
                                         r"128: not the same model, dtype or block size$"):
        other.add_peer(producer.metadata())
    consumer = NixlBlockTransfer(_cache(2, 2))
    peer = consumer.add_peer(producer.metadata())
    with pytest.raises(ValueError, match=r"^remote block ids \[4\] are outside 0\.\.3$"):
        consumer.read(peer, [4], [0])
    with pytest.raises(ValueError, match=r"^local block ids \[2\] are outside 0\.\.1$"):
        consumer.read(peer, [1], [2])
    with pytest.raises(ValueError, match=r"^2 remote blocks for 1 local ones$"):
        consumer.read(peer, [1, 2], [0])
    for forged in (b"\x80\x04K\x01.", b'{"agent": "!!", "geometry": {}}', b"[]"):  # (a pickle is not read)
        with pytest.raises(ValueError, match=r"^the peer's KV transfer metadata is not what a Tritium engine sends$"):
            consumer.add_peer(forged)
    with pytest.raises(ValueError, match=r"^kv_cache must be a contiguous \[2, layers, num_blocks, \.\.\.\] tensor"):
        NixlBlockTransfer(torch.zeros(3, 2, 2))


def _producer(conn) -> None:
    cache = _cache(8, 3)
    transfer = NixlBlockTransfer(cache)
    conn.send(transfer.metadata())
    conn.send(_notifications(transfer))
    conn.recv()  # the reader has compared: the cache may go
    transfer.close()


def test_a_reader_in_another_process_pulls_blocks():
    """The prefill and decode engines are separate processes: only metadata() crosses."""
    ctx = mp.get_context("spawn")  # (UCX, like CUDA, does not survive a fork of a process using it)
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(there,))
    proc.start()
    try:
        decode = torch.zeros(2, LAYERS, 4, BLOCK, HEADS, DIM, dtype=torch.bfloat16)
        consumer = NixlBlockTransfer(decode)
        peer = consumer.add_peer(here.recv())
        _wait(consumer, consumer.read(peer, [7, 0], [1, 2], b"done"))
        expected = _cache(8, 3)
        assert torch.equal(decode[:, :, 1], expected[:, :, 7]) and torch.equal(decode[:, :, 2], expected[:, :, 0])
        assert not decode[:, :, 0].any() and not decode[:, :, 3].any()
        assert here.recv() == [b"done"]
        here.send("bye")
        consumer.close()
    finally:
        proc.join(30)
        assert proc.exitcode == 0
