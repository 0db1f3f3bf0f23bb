"""The GPU engine (Triton kernels, CUDA graphs, prefill attention reading each chunk's keys and
values from the projection output) against the CPU engine (PyTorch references), both in float32
with a 16-bit cache: the same greedy tokens. Prompts are cut into chunks (so later chunks attend
to a cached prefix) and one prompt repeats (a prefix-cache hit). Skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

from tritium import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_gpu_engine_matches_the_cpu_engine(model_dir):
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (70, 33, 5, 130)]
    prompts.append(prompts[3][:96] + [7, 8, 9])  # shares six blocks with the fourth prompt
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    # Penalties on some rows (the Triton kernel from counts on the device against PyTorch's)
    penalized = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.6,
                               frequency_penalty=0.4, presence_penalty=0.2)
    params = [plain, penalized, plain, penalized, plain]
    # 48-token steps: the 70- and 130-token prompts arrive in chunks that follow a prefix.
    common = dict(dtype="float32", num_kv_blocks=256, max_num_batched_tokens=48,
                  enable_prefix_caching=True)
    gpu = LLM(model_dir, device="cuda", **common)
    assert gpu.engine.executor.runner.graphs
    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in LLM(model_dir, device="cpu", **common).generate(prompts, params)]
    assert got == want


@pytest.mark.parametrize("budget", [48, 2])
def test_gpu_prompt_logprobs_match_the_cpu_engine(llama_dir, budget):
    """Budget 48: prompt-only steps that would replay a prefill graph run eagerly with the
    prompt rows. Budget 2: one prompt token next to a decode, a step the decode graph runs."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (40, 17, 66)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    common = dict(dtype="float32", num_kv_blocks=128, max_num_batched_tokens=budget)
    gpu = LLM(llama_dir, device="cuda", **common)
    assert gpu.engine.executor.runner.graphs and gpu.engine.executor.runner.prefill_graphs
    got = gpu.generate(prompts, params)
    want = LLM(llama_dir, device="cpu", **common).generate(prompts, params)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs) and g.prompt_logprobs[0] is None
        for ge, we in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert set(ge) == set(we)
            for t, lp in we.items():
                assert ge[t].logprob == pytest.approx(lp.logprob, abs=1e-3)
                assert ge[t].rank == lp.rank


@pytest.mark.parametrize("lora", [False, True])
def test_no_triton_compile_while_serving(llama_dir, tmp_path, lora):
    """Start-up compiles every kernel variant a step can need (`warmup.compile_step_variants`, graph
    capture); a compile later stalls the step loop in front of clients (a first compile on a
    machine takes seconds). Steps of many shapes (eager and graph decodes of 1-40 rows, prompt
    chunks of 5 to 1,100 tokens, chunks after a cached prefix, n > 1, penalties; with a LoRA adapter
    on every other request) must compile nothing."""
    gen = torch.Generator().manual_seed(6)
    adapters = {}
    if lora:
        from lora_adapters import write_adapter
        adapters = dict(enable_lora=True, lora_modules={"a": write_adapter(
            str(tmp_path / "a"), llama_dir, ["q_proj", "v_proj", "down_proj"], 8, 16, seed=1)})
    llm = LLM(llama_dir, device="cuda", dtype="bfloat16", num_kv_blocks=2048, max_model_len=2048,
              max_num_batched_tokens=1536, enable_prefix_caching=True, **adapters)
    watch = llm.engine.executor.worker.compile_watch
    assert watch.installed and watch.compiles == 0
    for count, length, max_tokens in ((1, 5, 20), (3, 33, 9), (16, 16, 4), (17, 100, 6), (40, 7, 3),
                                      (2, 513, 5), (1, 1100, 4), (5, 1300, 3)):
        prompts = [torch.randint(3, 500, (length,), generator=gen).tolist() for _ in range(count)]
        prompts.append(prompts[0][:length // 2] + [9, 8, 7])  # a cached prefix, then a new chunk
        loras = [("a" if lora and i % 2 else None) for i in range(len(prompts))]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                     lora_request=loras)
    llm.generate([[5] * 300], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=5, ignore_eos=True))
    # Penalties on some rows and on all, each kind alone and together
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for kinds in (dict(repetition_penalty=1.2), dict(frequency_penalty=0.5), dict(presence_penalty=0.5),
                  dict(repetition_penalty=1.2, frequency_penalty=0.5)):
        penalized = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, **kinds)
        llm.generate([[5, 6, 7]] * 3, [penalized, plain, penalized])
        llm.generate([[5, 6, 7]] * 2, penalized)
    assert watch.compiles == 0, "kernels compiled while serving (the warnings above name them)"


def test_gpu_speculative_decoding_matches_the_cpu_engine(llama_dir):
    """Verification steps on the GPU (a chunk of the last token and the proposals over the cached
    context, through the Triton prefill kernel; steps without proposals through the decode
    graphs): proposals right, partly right and wrong, and the real n-gram proposer."""
    from test_spec_decode import NGRAM, _with_oracle
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (9, 40)]
    prompts.append(prompts[0] * 4)  # repeats itself: the n-gram proposer finds proposals
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(dtype="float32", num_kv_blocks=256)
    want = [o.outputs[0].token_ids for o in LLM(llama_dir, device="cpu", **common).generate(prompts, params)]
    gpu = LLM(llama_dir, device="cuda", speculative_config=NGRAM, **common)
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params)] == want
    _with_oracle(gpu.engine, {tuple(p): w for p, w in zip(prompts, want)}, wrong_every=3)
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params)] == want
    st = gpu.engine.get_stats()
    assert 0 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens


def test_gpu_speculation_of_many_sequences_with_logprobs_and_sampling(llama_dir):
    """More sequences than a prompt-only prefill graph takes (8) verify in one graph replay;
    logprobs of verified positions and rejection sampling run on the device: greedy rows give
    the CPU engine's tokens and logprobs, rows sampled at a temperature of 1e-3 (all but greedy,
    yet verified by rejection sampling) the greedy tokens."""
    from test_spec_decode import NGRAM, _with_oracle

    from tritium.worker.cuda_graph import PREFILL_GRAPH_MAX_SEQS
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in range(9, 21)]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    cold = SamplingParams(temperature=1e-3, max_tokens=20, ignore_eos=True)
    params = [greedy if i % 2 else cold for i in range(len(prompts))]
    common = dict(dtype="float32", num_kv_blocks=256)
    want = LLM(llama_dir, device="cpu", **common).generate(prompts, greedy)
    gpu = LLM(llama_dir, device="cuda", speculative_config=NGRAM, **common)
    assert gpu.engine.max_speculating_seqs >= len(prompts) > PREFILL_GRAPH_MAX_SEQS
    pg = gpu.engine.executor.runner.verify_graphs
    assert pg.max_chunk == NGRAM["num_speculative_tokens"] + 1 and gpu.engine.executor.runner.prefill_graphs.max_chunk is None
    replays, run = [], pg.run
    pg.run = lambda batch, rows=None: (rows is not None and replays.append(len(batch.prefill_cu_seqlens_q) - 1)
                                       or run(batch, rows))
    _with_oracle(gpu.engine, {tuple(p): w.outputs[0].token_ids for p, w in zip(prompts, want)}, wrong_every=3)
    got = [o.outputs[0] for o in gpu.generate(prompts, params)]
    assert [g.token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert max(replays) == len(prompts)  # verification steps of all twelve in one graph
    for g, w, p in zip(got, want, params):
        if p is greedy:
            for mine, theirs in zip(g.logprobs, w.outputs[0].logprobs):
                assert sorted(mine) == sorted(theirs)
                for t in mine:
                    assert mine[t].logprob == pytest.approx(theirs[t].logprob, abs=1e-3)
    st = gpu.engine.get_stats()
    assert 0 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens


def test_gpu_speculation_with_penalties_matches_the_cpu_engine(llama_dir):
    """Penalized rows of verification steps on the device: the Triton penalties kernel reads
    each row's counts with its earlier proposals added, and only kept tokens are counted;
    greedy and temperature-1e-3 rows give the CPU engine's tokens (without speculation)."""
    from test_spec_decode import NGRAM, _with_oracle
    gen = torch.Generator().manual_seed(17)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (9, 12, 15, 10)]
    pen = dict(repetition_penalty=1.3, frequency_penalty=0.6, presence_penalty=0.4)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **pen)
    cold = SamplingParams(temperature=1e-3, max_tokens=24, ignore_eos=True, **pen)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(dtype="float32", num_kv_blocks=256)
    want = [o.outputs[0].token_ids for o in
            LLM(llama_dir, device="cpu", **common).generate(prompts, [greedy, greedy, plain, greedy])]
    gpu = LLM(llama_dir, device="cuda", speculative_config=NGRAM, **common)
    _with_oracle(gpu.engine, {tuple(p): w for p, w in zip(prompts, want)}, wrong_every=3)
    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, [greedy, cold, plain, greedy])]
    assert got == want
    st = gpu.engine.get_stats()
    assert 10 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens


def test_gpu_draft_model_speculation_matches_the_cpu_engine(llama_dir):
    """A draft model on the GPU (its first pass through its prefill graphs, its one-token
    passes through its decode graphs, its cache beside the target's): greedy tokens are the
    CPU engine's; the target as its own draft is always right."""
    gen = torch.Generator().manual_seed(14)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (9, 40, 23)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(dtype="float32", num_kv_blocks=256, max_num_batched_tokens=32)
    want = [o.outputs[0].token_ids for o in LLM(llama_dir, device="cpu", **common).generate(prompts, params)]
    gpu = LLM(llama_dir, device="cuda", speculative_config={"model": llama_dir, "num_speculative_tokens": 3},
              **common)
    drafter = gpu.engine.executor.worker.drafter
    assert drafter.decode_graphs.graphs and drafter.prefill_graphs.graphs
    replays = []
    for graphs in (drafter.decode_graphs, drafter.prefill_graphs):
        run = graphs.run
        graphs.run = lambda *a, _run=run, _g=graphs: replays.append(type(_g).__name__) or _run(*a)
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params)] == want
    assert {"DecodeGraphs", "PrefillGraphs"} <= set(replays)
    st = gpu.engine.get_stats()
    assert 0 < st.spec_decode_num_accepted_tokens == st.spec_decode_num_draft_tokens


def test_gpu_eagle3_speculation_matches_the_cpu_engine(llama_dir, tmp_path):
    """An EAGLE-3 head on the GPU reads the target's kept hidden states from the decode,
    prefill and verification graphs' own buffers after each replay: its proposals are the CPU
    engine's (both float32), and the tokens are too."""
    from scripts.build_eagle_head import build_eagle3_head
    head = build_eagle3_head(str(tmp_path / "eagle3"), llama_dir, seed=3, draft_vocab_size=200,
                             aux_layer_ids=[0, 1, 2])
    gen = torch.Generator().manual_seed(15)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (9, 40, 23)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    common = dict(dtype="float32", num_kv_blocks=256, max_num_batched_tokens=32, speculative_config=spec)
    proposals = {}
    for device in ("cpu", "cuda"):
        llm = LLM(llama_dir, device=device, **common)
        drafter, made = llm.engine.executor.worker.drafter, []
        propose = drafter.propose
        drafter.propose = lambda *a, _p=propose, _m=made: _m.append(_p(*a)) or _m[-1]
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        proposals[device] = (tokens, [sorted(p.values()) for p in made])
    assert proposals["cuda"][0] == proposals["cpu"][0]
    same = sum(a == b for a, b in zip(proposals["cuda"][1], proposals["cpu"][1]))
    assert len(proposals["cuda"][1]) == len(proposals["cpu"][1]) and same >= 0.9 * len(proposals["cpu"][1])


def test_gpu_preemption_by_swap_matches_the_cpu_engine(llama_dir):
    """Preemption by swap on the GPU: the host pool page-locked in place, the gathers and
    scatters on the compute stream, the copies on the copy stream; greedy tokens in a cache far
    too small for the batch are the CPU engine's in a large one, and blocks went both ways."""
    gen = torch.Generator().manual_seed(16)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (30, 41, 22, 35)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(llama_dir, device="cpu", dtype="float32",
                                                  num_kv_blocks=256).generate(prompts, params)]
    gpu = LLM(llama_dir, device="cuda", dtype="float32", block_size=16, num_kv_blocks=8, max_num_batched_tokens=32,
              enable_prefix_caching=False, swap_space=0.01, preemption_mode="swap")
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params)] == want
    st = gpu.engine.get_stats()
    assert st.num_swapped_preemptions > 0 and st.num_blocks_swapped_in == st.num_blocks_swapped_out > 0


def test_gpu_host_prefix_tier_matches_the_cpu_engine(llama_dir):
    """The prefix cache's host tier on the GPU: a shared prompt evicted from a small device
    cache by four others comes back from pinned host memory (copies on the copy stream, the
    scatter on the compute stream) and its greedy tokens are the CPU engine's."""
    gen = torch.Generator().manual_seed(21)
    shared, *others = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (70, 66, 68, 70, 67)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    order = [shared, *others, shared]
    want = [o.outputs[0].token_ids for o in LLM(llama_dir, device="cpu", dtype="float32",
                                                  num_kv_blocks=256).generate(order, params)]
    gpu = LLM(llama_dir, device="cuda", dtype="float32", block_size=16, num_kv_blocks=12,
              max_num_batched_tokens=64, swap_space=0.01)
    assert [gpu.generate([p], params)[0].outputs[0].token_ids for p in order] == want
    st = gpu.engine.get_stats()
    assert st.external_prefix_cache_hits == 64 and st.num_blocks_reloaded == 4 and st.num_blocks_offloaded >= 4


def test_gpu_host_kv_cache_moves_large_swaps_through_its_staging_buffers_in_turn(monkeypatch):
    """Swaps of more blocks than a staging buffer holds go through the two buffers in turn
    (each taken again only after its last use ended): the same bytes back, FP8 included."""
    import tritium.worker.host_kv_cache as module
    from tritium.worker.host_kv_cache import HostKVCache
    for dtype in (torch.float16, torch.float8_e4m3fn):
        raw = torch.randint(0, 255, (2, 3, 40, 4, 2, 8 * dtype.itemsize), dtype=torch.uint8, device="cuda")
        monkeypatch.setattr(module, "STAGING_BYTES", 3 * raw[:, :, 0].numel())  # three blocks a batch
        host = HostKVCache(raw.view(dtype), num_host_blocks=24)
        assert host.max_batch == 3 and len(host._staging) == 2
        before = raw.clone()
        host.copy_log = []
        host.swap_out([(i, 23 - i) for i in range(20)])  # seven batches
        host.swap_in([(23 - i, 39 - i) for i in range(20)])
        torch.cuda.synchronize()
        block = raw[:, :, 0].numel()
        assert [(d, n) for d, n, _, _ in host.copy_log] == [("out", 3 * block)] * 6 + [("out", 2 * block)] \
            + [("in", 3 * block)] * 6 + [("in", 2 * block)]
        assert all(start.elapsed_time(end) >= 0 for _, _, start, end in host.copy_log)
        assert torch.equal(raw[:, :, 20:40], before[:, :, 0:20].flip(2))
        assert torch.equal(raw[:, :, 0:20], before[:, :, 0:20])
