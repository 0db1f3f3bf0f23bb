"""Multi-LoRA: requests naming different PEFT adapters (or none) in one batch get exactly the
greedy tokens of Hugging Face with that adapter merged into the weights; the prefix cache never
serves one adapter's keys and values to another; bad adapters and names get clear errors.
These run the CPU engine (device="cpu" also on a GPU machine); the last test holds the GPU
engine, its kernels and CUDA graphs, to the CPU engine's tokens."""
from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy_generate
from lora_adapters import merged_hf_model, write_adapter

from tritium import LLM, EngineArgs, LoRARequest, SamplingParams

# min_tokens: EOS masked as Hugging Face's min_new_tokens masks it (the adapters make EOS likely).
GREEDY = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
CPU = dict(device="cpu")
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def llama_adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {
        # q and v only (k's part of the fused projection stays without a delta), rank 8
        "qv": write_adapter(str(root / "qv"), llama_dir, ["q_proj", "v_proj"], 8, 16, seed=1),
        # every projection, rank 16, rsLoRA scaling, only layer 1
        "all": write_adapter(str(root / "all"), llama_dir, ALL, 16, 8, seed=2, use_rslora=True,
                             layers=[1]),
        "mlp": write_adapter(str(root / "mlp"), llama_dir, ["gate_proj", "down_proj"], 4, 4, seed=3),
    }


def _prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (length,), generator=gen).tolist() for length in (37, 9, 70, 21)[:n]]


def _hf(model_dir, adapter_dir, prompts, max_new=12):
    return hf_greedy_generate(merged_hf_model(model_dir, adapter_dir), prompts, max_new)


def test_each_request_gets_its_adapter_in_a_mixed_batch(llama_dir, llama_adapters):
    prompts = _prompts(4, seed=1)
    names = [None, "qv", "all", "mlp"]
    want = {name: _hf(llama_dir, llama_adapters.get(name), prompts) for name in names}
    # Each adapter changes the output: the test could tell them apart.
    assert len({str(tokens) for tokens in want.values()}) == len(names)
    llm = LLM(llama_dir, enable_lora=True, lora_modules=llama_adapters, max_lora_rank=16,
              max_num_batched_tokens=64, **CPU)  # prompts in chunks, next to other requests' decodes
    batch = [p for p in prompts for _ in names]
    loras = [name for _ in prompts for name in names]
    outs = llm.generate(batch, GREEDY, lora_request=loras)
    for i, (prompt_index, name) in enumerate((p, n) for p in range(len(prompts)) for n in names):
        assert outs[i].outputs[0].token_ids == want[name][prompt_index], (name, prompt_index)
    # A LoRARequest (vLLM's form) names the same adapter.
    again = llm.generate(prompts[:1], GREEDY, lora_request=LoRARequest("mlp", 3, llama_adapters["mlp"]))
    assert again[0].outputs[0].token_ids == want["mlp"][0]


def test_fused_checkpoint_projections(phi3_dir, tmp_path):
    """Phi-3 adapters target its fused qkv_proj and gate_up_proj."""
    adapter = write_adapter(str(tmp_path / "phi"), phi3_dir, ["qkv_proj", "gate_up_proj", "o_proj"], 8, 16, seed=4)
    prompts = _prompts(2, seed=2)
    want = _hf(phi3_dir, adapter, prompts)
    assert want != _hf(phi3_dir, None, prompts)
    llm = LLM(phi3_dir, enable_lora=True, lora_modules={"p": adapter}, max_model_len=512, **CPU)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, lora_request="p")] == want


def test_more_adapters_than_device_slots(llama_dir, llama_adapters, monkeypatch):
    """max_loras=1: three adapters take turns in the one slot. Every request still gets its own
    adapter's tokens, no step mixes two adapters, and requests of other adapters wait while
    requests without one go ahead."""
    prompts = _prompts(4, seed=5)
    names = ["qv", "all", None, "mlp", "qv", None]
    batch = [prompts[i % 4] for i in range(len(names))]
    refs = {n: _hf(llama_dir, llama_adapters.get(n), prompts) for n in set(names)}
    llm = LLM(llama_dir, enable_lora=True, lora_modules=llama_adapters, max_loras=1, **CPU)
    scheduler = llm.engine.scheduler
    steps = []
    schedule = scheduler.schedule

    stats = []

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        steps.append([scheduler.sequence(it.seq_id).lora_name for it in out.scheduled])
        stats.append(llm.engine.get_stats())
        return out
    monkeypatch.setattr(scheduler, "schedule", recording)
    outs = llm.generate(batch, GREEDY, lora_request=names)
    assert [o.outputs[0].token_ids for o in outs] == [refs[n][i % 4] for i, n in enumerate(names)]
    assert all(len(set(step) - {None}) <= 1 for step in steps), steps
    assert steps[0] == ["qv", None, "qv", None]  # "all" and "mlp" wait for the slot
    first = stats[0]  # what vllm:lora_requests_info publishes
    assert (first.max_lora, first.running_lora_adapters, first.waiting_lora_adapters) == (1, "qv", "all,mlp")
    assert scheduler.lora_slots.num_loads == 2 and scheduler.lora_slots.refs == [0]


def test_prefix_cache_keeps_adapters_apart(llama_dir, llama_adapters):
    prompt = _prompts(3, seed=3)[2]  # 70 tokens: four full blocks of 16
    llm = LLM(llama_dir, enable_lora=True, lora_modules=llama_adapters, enable_prefix_caching=True, **CPU)
    first = llm.generate([prompt], GREEDY, lora_request="qv")[0]
    other = llm.generate([prompt], GREEDY, lora_request="all")[0]
    base = llm.generate([prompt], GREEDY)[0]
    same = llm.generate([prompt], GREEDY, lora_request="qv")[0]
    assert (other.num_cached_tokens, base.num_cached_tokens) == (0, 0)
    assert same.num_cached_tokens == 64
    assert same.outputs[0].token_ids == first.outputs[0].token_ids == _hf(llama_dir, llama_adapters["qv"], [prompt])[0]
    assert other.outputs[0].token_ids == _hf(llama_dir, llama_adapters["all"], [prompt])[0]
    assert base.outputs[0].token_ids == _hf(llama_dir, None, [prompt])[0]


def test_bad_names_get_clear_errors(llama_dir, llama_adapters):
    llm = LLM(llama_dir, enable_lora=True, lora_modules={"qv": llama_adapters["qv"]}, **CPU)
    with pytest.raises(ValueError, match=r"^lora_name 'nope' is not an adapter of this model; it serves 'qv'\.$"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request="nope")
    plain = LLM(llama_dir, max_model_len=128, **CPU)
    with pytest.raises(ValueError, match=r"^lora_name 'qv': this model serves no LoRA adapters "
                                         r"\(start it with enable_lora and lora_modules\)\.$"):
        plain.generate([[5, 6, 7]], GREEDY, lora_request="qv")
    with pytest.raises(ValueError, match=r"^Got 2 LoRA requests for 1 prompts\.$"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=["qv", None])


def test_requests_bring_adapters_and_host_memory_keeps_max_cpu_loras(llama_dir, llama_adapters, tmp_path):
    """vLLM's in-process form: no adapters listed, each request's LoRARequest brings its
    directory; later requests may name it alone. With max_cpu_loras=1 (and one device slot)
    host memory keeps the last adapter used, and one dropped is read from disk again when it
    next takes the slot: every request still gets its adapter's tokens."""
    prompts = _prompts(2, seed=6)
    refs = {n: _hf(llama_dir, llama_adapters.get(n), prompts) for n in ("qv", "mlp", None)}
    llm = LLM(llama_dir, enable_lora=True, max_loras=1, max_cpu_loras=1, **CPU)
    manager = llm.engine.executor.worker.lora_manager
    assert (manager.num_slots, manager.host_adapters, manager.disk_reads) == (1, [], 0)
    # With none listed, every projection takes adapters (the "mlp" one targets no attention).
    assert all(layer.self_attn.o_proj.lora is not None and layer.mlp.down_proj.lora is not None
               for layer in llm.engine.executor.worker.model.model.layers)

    def run(lora):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, lora_request=lora)]
    assert run(LoRARequest("qv", 1, llama_adapters["qv"])) == refs["qv"]
    assert run(LoRARequest("mlp", 2, llama_adapters["mlp"])) == refs["mlp"]
    assert (manager.host_adapters, manager.disk_reads) == (["mlp"], 2)
    assert run("qv") == refs["qv"]  # by name, read from its directory again
    assert (manager.host_adapters, manager.disk_reads) == (["qv"], 3)
    mixed = llm.generate(prompts * 3, GREEDY, lora_request=["mlp", "mlp", None, None, "qv", "qv"])
    assert [o.outputs[0].token_ids for o in mixed] == refs["mlp"] + refs[None] + refs["qv"]
    assert len(manager.host_adapters) == 1
    with pytest.raises(ValueError, match=r"^LoRA adapter 'qv' is already served from '.*/qv'; another "
                                         r"adapter needs another name \(got '.*/mlp'\)\.$"):
        llm.generate(prompts, GREEDY, lora_request=LoRARequest("qv", 1, llama_adapters["mlp"]))
    with pytest.raises(ValueError, match=r"^LoRA adapter 'n': '.*' has no adapter_config\.json\.$"):
        llm.generate(prompts, GREEDY, lora_request=LoRARequest("n", 4, str(tmp_path)))
    with pytest.raises(ValueError, match=r"^lora_name 'n' is not an adapter of this model; it serves 'qv', 'mlp'\.$"):
        llm.generate(prompts, GREEDY, lora_request="n")
    assert run("mlp") == refs["mlp"]  # the failures left the engine serving
    fresh = LLM(llama_dir, enable_lora=True, max_model_len=128, **CPU)
    with pytest.raises(ValueError, match=r"^lora_name 'qv' is not an adapter of this model; it serves none "
                                         r"yet \(a LoRARequest with a lora_path adds one\)\.$"):
        fresh.generate(prompts, GREEDY, lora_request="qv")


def test_listed_adapters_beyond_max_cpu_loras_are_checked_then_dropped(llama_dir, llama_adapters, tmp_path):
    """Start-up reads and checks every listed adapter but keeps only max_cpu_loras of them
    read; the others are read again when a request needs them. A bad adapter past that bound
    still fails the load."""
    prompts = _prompts(2, seed=9)
    llm = LLM(llama_dir, enable_lora=True, lora_modules=llama_adapters, max_loras=1, max_cpu_loras=1, **CPU)
    manager = llm.engine.executor.worker.lora_manager
    assert (manager.disk_reads, manager.host_adapters, manager.resident) == (3, ["qv"], ["qv"])
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, lora_request="mlp")]
    assert got == _hf(llama_dir, llama_adapters["mlp"], prompts)
    assert (manager.disk_reads, manager.host_adapters) == (4, ["mlp"])
    wrong = write_adapter(str(tmp_path / "wrong"), llama_dir, ["o_proj"], 4, 4, seed=7, extra_tensors={
        "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight": torch.zeros(4, 10)})
    with pytest.raises(ValueError, match=r"^LoRA adapter 'w': layer 0 o_proj maps 10 -> 64 features"):
        LLM(llama_dir, enable_lora=True, lora_modules={**llama_adapters, "w": wrong}, max_loras=1,
            max_cpu_loras=1, max_model_len=128, **CPU)


def test_a_brought_adapter_must_fit_the_listed_adapters_projections(llama_dir, llama_adapters):
    """Listed adapters decide which projections hold slots (no kernel work on the others)."""
    llm = LLM(llama_dir, enable_lora=True, lora_modules={"qv": llama_adapters["qv"]}, max_model_len=128, **CPU)
    assert llm.engine.executor.worker.model.model.layers[0].mlp.down_proj.lora is None
    with pytest.raises(ValueError, match=r"^LoRA adapter 'mlp' targets layer 0 down_proj, layer 0 gate_proj, "
                                         r"layer 1 down_proj, layer 1 gate_proj, which no adapter listed at "
                                         r"start-up targets; list one that does in lora_modules \(or list none, "
                                         r"so that every projection takes adapters\)\.$"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("mlp", 2, llama_adapters["mlp"]))


def test_bad_adapters_fail_the_load(llama_dir, llama_adapters, tmp_path):
    def load(**kwargs):
        return LLM(llama_dir, enable_lora=True, max_model_len=128, **CPU, **kwargs)

    with pytest.raises(ValueError, match=r"^LoRA adapter 'all' has rank 16, more than max_lora_rank=8; raise max_lora_rank\.$"):
        load(lora_modules={"all": llama_adapters["all"]}, max_lora_rank=8)
    emb = write_adapter(str(tmp_path / "emb"), llama_dir, ["q_proj"], 4, 4, seed=5, extra_tensors={
        "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 512)})
    with pytest.raises(ValueError, match=r"^LoRA adapter 'e': tensor 'base_model\.model\.model\.embed_tokens\.lora_embedding_A' "
                                         r"is not a LoRA weight of a supported projection"):
        load(lora_modules={"e": emb})
    dora = write_adapter(str(tmp_path / "dora"), llama_dir, ["q_proj"], 4, 4, seed=6, extra_config={"use_dora": True})
    with pytest.raises(ValueError, match=r"^LoRA adapter 'd': DoRA is not supported\.$"):
        load(lora_modules={"d": dora})
    wrong = write_adapter(str(tmp_path / "wrong"), llama_dir, ["o_proj"], 4, 4, seed=7, extra_tensors={
        "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight": torch.zeros(4, 10)})
    with pytest.raises(ValueError, match=r"^LoRA adapter 'w': layer 0 o_proj maps 10 -> 64 features, "
                                         r"but the model's maps 64 -> 64\.$"):
        load(lora_modules={"w": wrong})
    with pytest.raises(ValueError, match=r"^LoRA adapter 'n': '.*' has no adapter_config\.json\.$"):
        load(lora_modules={"n": str(tmp_path)})
    with pytest.raises(ValueError, match=r"^lora_modules: adapter 'x': directory '/no/such' does not exist\.$"):
        EngineArgs(model=llama_dir, enable_lora=True, lora_modules={"x": "/no/such"})
    with pytest.raises(ValueError, match=r"^lora_modules needs enable_lora=true\.$"):
        EngineArgs(model=llama_dir, lora_modules={"w": wrong})
    with pytest.raises(ValueError, match=r"^max_cpu_loras=1 is less than the 2 adapter slots \(max_loras\); "
                                         r"host memory must hold every adapter in a slot\.$"):
        EngineArgs(model=llama_dir, enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match=r"^max_cpu_loras=1 is less than the 3 adapter slots"):
        EngineArgs(model=llama_dir, enable_lora=True, lora_modules=llama_adapters, max_cpu_loras=1)
    args = EngineArgs.from_strings({"model": llama_dir, "enable_lora": "true",
                                    "lora_modules": '{"w": "%s"}' % wrong})
    assert args.lora_modules == {"w": wrong}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("budget,max_loras", [(8192, None), (64, None), (8192, 1)])
def test_gpu_graphs_match_the_cpu_engine(llama_dir, llama_adapters, budget, max_loras):
    """The GPU engine with adapters per row against the CPU engine. Budget 8192: a prefill
    graph for the first step, then decode graphs. Budget 64: prompt chunks next to decodes, in
    eager steps whose last layer keeps only the sampled rows. max_loras=1: the adapters take
    turns in one device slot, copied in between steps the graphs replay."""
    prompts = _prompts(4, seed=4) + [[11, 12, 13]]
    names = ["qv", None, "all", "mlp", "qv"]
    common = dict(dtype="float32", num_kv_blocks=256, enable_lora=True, lora_modules=llama_adapters,
                  max_num_batched_tokens=budget, max_loras=max_loras)
    gpu = LLM(llama_dir, device="cuda", **common)
    assert gpu.engine.executor.runner.graphs and gpu.engine.executor.runner.prefill_graphs
    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, GREEDY, lora_request=names)]
    alone = [gpu.generate([p], GREEDY, lora_request=n)[0].outputs[0].token_ids for p, n in zip(prompts, names)]
    want = [o.outputs[0].token_ids for o in LLM(llama_dir, device="cpu", **common).generate(prompts, GREEDY, lora_request=names)]
    assert got == want and alone == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_adapters_brought_by_requests_with_one_in_host_memory(llama_dir, llama_adapters):
    """No adapters listed, LoRARequests bring them, one device slot and max_cpu_loras=1: every
    change of adapter drops the last one's pinned host copy right after its copy to the device
    was queued, and reads the next one from disk (graphs replaying in between): the GPU engine
    gives the CPU engine's tokens."""
    prompts = _prompts(4, seed=7)
    order = ["qv", "mlp", "all", "qv", "mlp"]
    common = dict(dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=1, max_cpu_loras=1)
    results = []
    for device in ("cuda", "cpu"):
        llm = LLM(llama_dir, device=device, **common)
        results.append([[o.outputs[0].token_ids for o in llm.generate(
            prompts, GREEDY, lora_request=LoRARequest(name, 1, llama_adapters[name]))] for name in order])
        assert llm.engine.executor.worker.lora_manager.disk_reads == len(order)
    assert results[0] == results[1]


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_projection_adds_the_delta_of_each_rows_adapter(quantization):
    """Whatever computes the projection (16/32-bit or FP8 weights), LoRA adds each row's delta
    to its output, from the unquantized input, and rows without an adapter stay as they were;
    the last layer's narrowing to sampled rows narrows the adapters too."""
    from tritium.layers.forward_context import LoRAMapping, select_lora_rows, set_lora_mapping
    from tritium.layers.linear import ReplicatedLinear
    from tritium.layers.quantization import get_linear_method, process_weights_after_loading
    from tritium.worker.lora import LoRAWeights
    from tritium.kernels.reference import add_lora_ref

    gen = torch.Generator().manual_seed(0)
    layer = ReplicatedLinear(32, 24, linear_method=get_linear_method(quantization))
    layer.weight.data.copy_(torch.randn(24, 32, generator=gen))
    process_weights_after_loading(layer)
    layer.lora = LoRAWeights(torch.randn(2, 16, 32, generator=gen), torch.randn(2, 24, 16, generator=gen))
    x = torch.randn(6, 32, generator=gen)
    slots = torch.tensor([1, -1, 0, 0, -1, 1])
    base = layer(x)  # no mapping: no adapter in the step
    with set_lora_mapping(LoRAMapping(slots)):
        got = layer(x)
        rows = torch.tensor([4, 0])
        select_lora_rows(rows)
        narrowed = layer(x[rows])
    want = add_lora_ref(base.clone(), x, layer.lora.a, layer.lora.b, slots)
    assert torch.equal(got, want) and torch.equal(got[[1, 4]], base[[1, 4]])
    assert torch.equal(narrowed, add_lora_ref(layer(x[rows]), x[rows], layer.lora.a, layer.lora.b, slots[rows]))


def test_samples_of_one_request_share_its_adapter(llama_dir, llama_adapters):
    """n > 1: the forked samples run with the parent's adapter and hold its slot until they end."""
    prompt = _prompts(1, seed=6)[0]
    llm = LLM(llama_dir, enable_lora=True, lora_modules=llama_adapters, max_loras=1, **CPU)
    params = SamplingParams(n=3, temperature=0, max_tokens=12, min_tokens=12)
    outs = llm.generate([prompt, prompt], params, lora_request=["mlp", "qv"])
    assert [c.token_ids for c in outs[0].outputs] == [_hf(llama_dir, llama_adapters["mlp"], [prompt])[0]] * 3
    assert [c.token_ids for c in outs[1].outputs] == [_hf(llama_dir, llama_adapters["qv"], [prompt])[0]] * 3
    assert llm.engine.scheduler.lora_slots.refs == [0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_speculating_requests_keep_their_adapters(llama_dir, llama_adapters, device):
    """Verification steps carry each row's adapter (on the GPU through the verification graphs'
    LoRA row): with proposals right and partly wrong, requests of three adapters and of the
    base model give the tokens they give without speculation."""
    from test_spec_decode import NGRAM, _with_oracle
    prompts = _prompts(4, seed=6)
    names = [None, "qv", "all", "mlp"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    common = dict(dtype="float32", num_kv_blocks=256, enable_lora=True, lora_modules=llama_adapters,
                  max_lora_rank=16)
    cpu = LLM(llama_dir, device="cpu", **common)
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, lora_request=names)]
    base = [o.outputs[0].token_ids for o in cpu.generate(prompts, params)]
    assert base[0] == want[0] and all(b != w for b, w in zip(base[1:], want[1:]))  # the adapters matter
    llm = LLM(llama_dir, device=device, speculative_config=NGRAM, **common)
    _with_oracle(llm.engine, {tuple(p): w for p, w in zip(prompts, want)}, wrong_every=3)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=names)]
    assert got == want
    st = llm.engine.get_stats()
    assert 12 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens
