"""Disaggregated prefill offline: a producer engine prefills (max_tokens=1, kv_transfer_params
{"do_remote_decode": true}) and keeps the prompt's blocks; a consumer engine given the
producer's returned kv_transfer_params reads them through NIXL instead of computing the prompt,
and its greedy tokens equal one engine's; the producer frees the blocks once read, the consumer
reads again only what its prefix cache lacks; misuse gets clear errors."""
from __future__ import annotations

import pytest
import torch

from tritium import EngineArgs, LLMEngine, SamplingParams

NIXL = {"kv_connector": "NixlConnector"}


def _engine(model: str, role: str | None, **extra) -> LLMEngine:
    config = None if role is None else {**NIXL, "kv_role": role}
    return LLMEngine(EngineArgs(model=model, dtype="float32", block_size=4, kv_transfer_config=config, **extra))


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens = {rid: [] for rid in requests}
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
            if out.finished:
                finals[out.request_id] = out
    return tokens, finals


@pytest.fixture(scope="module")
def pair(llama_dir):
    """(one engine, a producer, a consumer), shared: each test leaves their caches empty."""
    engines = _engine(llama_dir, None), _engine(llama_dir, "kv_producer"), _engine(llama_dir, "kv_consumer")
    yield engines
    for engine in engines:
        engine.shutdown()


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(53)
    return {f"r{i}": torch.randint(3, 500, (n,), generator=g).tolist() for i, n in enumerate((30, 17, 9, 2))}


def test_consumer_reads_the_producers_blocks_and_decodes_one_engines_tokens(pair):
    prompts = _prompts()
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain, producer, consumer = pair
    want, _ = _run(plain, {rid: (p, greedy) for rid, p in prompts.items()})

    prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                             extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    first, produced = _run(producer, {rid: (p, prefill) for rid, p in prompts.items()})
    for rid, p in prompts.items():
        params = produced[rid].kv_transfer_params
        assert first[rid] == want[rid][:1]
        assert params["do_remote_prefill"] and params["remote_num_tokens"] == len(p)
        assert len(params["remote_block_ids"]) == -(-len(p) // 4)
    held = producer.block_manager.num_blocks - producer.block_manager.num_free_blocks
    assert held == sum(-(-len(p) // 4) for p in prompts.values())

    decode = {rid: (p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                      extra_args={"kv_transfer_params": produced[rid].kv_transfer_params}))
              for rid, p in prompts.items()}
    got, finals = _run(consumer, decode)
    assert got == want
    connector = consumer.kv_connector
    # r3's prompt has 2 tokens: its one key to read sits in one block; every prompt was read.
    assert connector.num_transfers == 4
    assert connector.num_blocks_transferred == sum(-(-(len(p) - 1) // 4) for p in prompts.values())
    assert all(f.kv_transfer_params is None for f in finals.values())
    stats = consumer.get_stats()
    assert (stats.kv_transfers, stats.kv_transfer_blocks) == (4, connector.num_blocks_transferred)
    g = consumer.executor.kv_transfer.geometry  # a block: K and V of every layer
    assert stats.kv_transfer_bytes == stats.kv_transfer_blocks * 2 * g.num_layers * g.region_bytes > 0
    assert stats.kv_transfer_seconds > 0
    # The consumer told the producer, which frees the blocks at its next step.
    for _ in range(200):
        producer.step()
        if producer.block_manager.num_free_blocks == producer.block_manager.num_blocks:
            break
    producer.block_manager.check_integrity([])
    assert producer.block_manager.num_free_blocks == producer.block_manager.num_blocks
    consumer.block_manager.check_integrity([])
    assert consumer.block_manager.num_free_blocks == consumer.block_manager.num_blocks

    # Again on the consumer: its prefix cache holds the prompt's full blocks, only the rest is read.
    before = connector.num_blocks_transferred
    p = prompts["r0"]
    _, again = _run(producer, {"again": (p, prefill)})
    got, _ = _run(consumer, {"again": (p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, extra_args={
        "kv_transfer_params": again["again"].kv_transfer_params}))})
    assert got["again"] == want["r0"]
    assert connector.num_blocks_transferred - before == 1  # tokens 28..29 (29 = the last, computed here)


def test_misuse_is_refused_clearly(pair, llama_dir):
    plain, _, consumer = pair
    remote = {"kv_transfer_params": {"do_remote_decode": True}}
    with pytest.raises(ValueError, match=r"^kv_transfer_params needs an engine started with kv_transfer_config\.$"):
        plain.add_request("a", [5, 6, 7], SamplingParams(extra_args=remote))
    with pytest.raises(ValueError, match=r"^kv_transfer_params\.do_remote_decode needs a producer engine "
                                         r"\(kv_role kv_producer or kv_both\), this one is kv_consumer\.$"):
        consumer.add_request("a", [5, 6, 7], SamplingParams(extra_args=remote))
    with pytest.raises(ValueError, match=r"^kv_transfer_params lacks remote_engine_id, remote_block_ids, "):
        consumer.add_request("b", [5, 6, 7], SamplingParams(extra_args={"kv_transfer_params": {"do_remote_prefill": True}}))
    forged = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [1, None],
              "remote_num_tokens": 3, "remote_metadata": "e30=", "remote_request_key": "k"}
    with pytest.raises(ValueError, match=r"^kv_transfer_params: remote_block_ids must be the 1 block ids the "
                                         r"producer returned for this prompt\.$"):
        consumer.add_request("c", [5, 6, 7], SamplingParams(extra_args={"kv_transfer_params": forged}))
    with pytest.raises(ValueError, match=r"^kv_transfer_params: the producer computed 3 prompt tokens, this "
                                         r"request has 2: not the same prompt\.$"):
        consumer.add_request("d", [5, 6], SamplingParams(extra_args={"kv_transfer_params": forged}))
    with pytest.raises(ValueError, match=r"^kv_transfer_config: kv_connector must be one of NixlConnector, got 'P2p'\.$"):
        EngineArgs(model=llama_dir, kv_transfer_config={"kv_connector": "P2p"})
    with pytest.raises(ValueError, match=r"^kv_transfer_config: kv_role must be one of kv_producer, kv_consumer, "
                                         r"kv_both, got 'decoder'\.$"):
        EngineArgs(model=llama_dir, kv_transfer_config={**NIXL, "kv_role": "decoder"})
    with pytest.raises(ValueError, match=r"^kv_transfer_config: num_threads must be an integer from 0 to 64, "
                                         r"got 65\.$"):
        EngineArgs(model=llama_dir, kv_transfer_config={**NIXL, "kv_connector_extra_config": {"num_threads": 65}})
    assert not plain.has_unfinished_requests() and not consumer.has_unfinished_requests()


def _fresh(n: int, seed: int) -> list[int]:
    """A prompt no earlier test cached (the engines are shared)."""
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(1000 + seed)).tolist()


def _prefill(producer: LLMEngine, rid: str, prompt: list[int]) -> dict:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                            extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    return _run(producer, {rid: (prompt, params)})[1][rid].kv_transfer_params


def _decode(params: dict, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args={"kv_transfer_params": params})


def test_a_request_cancelled_while_its_blocks_are_read_frees_them_once_the_read_ends(pair, monkeypatch):
    from tritium.kv_transfer.nixl_blocks import NixlBlockTransfer
    _, producer, consumer = pair
    prompt = _fresh(21, 1)
    params = _prefill(producer, "a", prompt)
    # The read is held "in flight" for a few polls, as a long one on a GPU would be.
    real, delayed = NixlBlockTransfer.poll, [3]

    def slow_poll(self, handle):
        if delayed[0] > 0:
            delayed[0] -= 1
            return False
        return real(self, handle)
    monkeypatch.setattr(NixlBlockTransfer, "poll", slow_poll)
    consumer.add_request("a", prompt, _decode(params))
    consumer.step()
    assert consumer.kv_connector.busy and consumer.scheduler.loading
    out = consumer.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    bm = consumer.block_manager
    assert bm.num_free_blocks < bm.num_blocks  # NIXL may still write into them
    while consumer.has_unfinished_requests():
        consumer.step()
    bm.check_integrity([])
    assert bm.num_free_blocks == bm.num_blocks and not bm.held
    for _ in range(200):  # the read ended: the producer is told and frees its blocks
        producer.step()
        if not producer.block_manager.held:
            break
    assert producer.block_manager.num_free_blocks == producer.block_manager.num_blocks


def test_a_dead_producer_fails_the_request_clearly_and_the_consumer_serves_on(pair, llama_dir):
    plain, alive, consumer = pair
    prompt = _fresh(13, 2)
    want, _ = _run(plain, {"w": (prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))})
    dead = _engine(llama_dir, "kv_producer")
    params = _prefill(dead, "a", prompt)
    dead.shutdown()  # its NIXL agent ends, as when its process dies
    _, finals = _run(consumer, {"a": (prompt, _decode(params))})
    error = finals["a"].error
    assert error is not None and error.kind == "unavailable"
    # (NIXL finds the peer gone when it connects, or when the read starts)
    assert error.startswith(f"Reading the prompt's KV cache from engine {params['remote_engine_id']} failed: "
                            f"NIXL could not ")
    bm = consumer.block_manager
    bm.check_integrity([])
    assert bm.num_free_blocks == bm.num_blocks and not consumer.has_unfinished_requests()
    got, _ = _run(consumer, {"b": (prompt, _decode(_prefill(alive, "b", prompt)))})
    assert got["b"] == want["w"]
