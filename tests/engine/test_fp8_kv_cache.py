"""kv_cache_dtype="fp8": keys (after rotary) and values are stored as float8 e4m3 divided by their
per-tensor scales, and attention reads them back widened. On the CPU the engine must match, token
for token, a Hugging Face model whose keys and values go through the same quantize-dequantize by
hand; the pool holds twice the blocks of a float16 one in the same bytes."""
from __future__ import annotations

import importlib

import pytest
import torch
from hf_reference import hf_greedy_generate
from transformers import AutoModelForCausalLM, AutoTokenizer

from tritium import LLM, EngineArgs, SamplingParams
from tritium.config import CPU_KV_CACHE_BYTES
from tritium.kernels import reference

MAX_NEW = 12
K_SCALE, V_SCALE = 0.05, 0.02
PROMPTS = ["The engine streams tokens", "A paged cache holds blocks of keys and values",
           "x", "GPU kernels read the cache in place while the scheduler batches users"]


def fake_quant(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (reference.quantize_kv_ref(x, scale).float() * scale).to(x.dtype)


def hf_fp8_kv_greedy(model_dir: str, prompts: list[list[int]], monkeypatch) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    module = importlib.import_module(type(model.model.layers[0].self_attn).__module__)
    rotary = module.apply_rotary_pos_emb

    def rotary_then_quantize_keys(q, k, cos, sin, *args, **kwargs):
        q, k = rotary(q, k, cos, sin, *args, **kwargs)
        return q, fake_quant(k, K_SCALE)

    monkeypatch.setattr(module, "apply_rotary_pos_emb", rotary_then_quantize_keys)
    kv_size = model.config.num_key_value_heads * model.model.layers[0].self_attn.head_dim

    def quantize_values_of_fused_qkv(_m, _i, out):  # Phi-3: the values are the last kv_size columns
        return torch.cat([out[..., :-kv_size], fake_quant(out[..., -kv_size:], V_SCALE)], dim=-1)

    for layer in model.model.layers:
        attn = layer.self_attn
        if hasattr(attn, "v_proj"):
            attn.v_proj.register_forward_hook(lambda _m, _i, out: fake_quant(out, V_SCALE))
        else:
            attn.qkv_proj.register_forward_hook(quantize_values_of_fused_qkv)
    return hf_greedy_generate(model, prompts, MAX_NEW)


def test_fp8_kv_cache_matches_hf_with_the_same_fake_quantization(model_dir, monkeypatch):
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    llm = LLM(model_dir, dtype="float32", device="cpu", kv_cache_dtype="fp8", k_scale=K_SCALE,
              v_scale=V_SCALE)
    assert llm.engine.executor.worker.kv_cache.dtype == torch.float8_e4m3fn
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == hf_fp8_kv_greedy(model_dir, prompts, monkeypatch)
    # The quantization is real: the same prompts with a float32 cache give other log-probabilities.
    exact = LLM(model_dir, dtype="float32", device="cpu").generate(prompts, params)
    assert [o.outputs[0].cumulative_logprob for o in outs] != [
        o.outputs[0].cumulative_logprob for o in exact]


def test_fp8_pool_holds_twice_the_blocks(llama_dir):
    sizes = {}
    for kv_dtype in ("auto", "fp8"):
        worker = LLM(llama_dir, dtype="float16", device="cpu", kv_cache_dtype=kv_dtype,
                     max_model_len=2048, max_num_seqs=4096).engine.executor.worker
        sizes[kv_dtype] = (worker.num_blocks, worker.block_bytes)
    (blocks16, bytes16), (blocks8, bytes8) = sizes["auto"], sizes["fp8"]
    assert bytes8 * 2 == bytes16
    assert blocks16 == CPU_KV_CACHE_BYTES // bytes16 and blocks8 == CPU_KV_CACHE_BYTES // bytes8
    assert blocks8 == 2 * blocks16


def test_fp8_cache_forks_copy_on_write_like_one_request(llama_dir, monkeypatch):
    """n=3 greedy forks share the prompt's partial block and copy it on their first write; the
    copy moves FP8 keys and transposed values as bytes, so each fork continues exactly as a
    lone request does."""
    llm = LLM(llama_dir, kv_cache_dtype="fp8", k_scale=K_SCALE, v_scale=V_SCALE)
    executor = llm.engine.executor
    copies = []
    execute = executor.execute_model
    monkeypatch.setattr(executor, "execute_model", lambda step: (
        copies.extend(step.block_copies), execute(step))[1])
    params = dict(temperature=0, max_tokens=8, ignore_eos=True)
    one = llm.generate([[0, 3, 5]], SamplingParams(**params))[0].outputs[0].token_ids
    many = llm.generate([[0, 3, 5]], SamplingParams(n=3, **params))[0].outputs
    assert len(copies) == 2  # two of the three forks copied the shared block
    assert [o.token_ids for o in many] == [one] * 3


def test_fp8_cache_prefix_hit_reads_the_cached_blocks(llama_dir):
    """A second request with the same 40-token prompt reuses two FP8 blocks from the prefix
    cache and attends to them (keys and transposed values) exactly as the first computed them."""
    llm = LLM(llama_dir, kv_cache_dtype="fp8", k_scale=K_SCALE, v_scale=V_SCALE)
    prompt = list(range(3, 43))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    first, second = (llm.generate([prompt], params)[0] for _ in range(2))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.outputs[0].cumulative_logprob == pytest.approx(first.outputs[0].cumulative_logprob,
                                                                 abs=1e-5)


def test_kv_cache_arguments_are_checked(llama_dir):
    with pytest.raises(ValueError, match=r"^kv_cache_dtype must be one of auto, fp8, fp8_e4m3; "
                                         r"got 'int8'\.$"):
        EngineArgs(model=llama_dir, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match=r"^k_scale must be a positive finite number, got 0\.0\.$"):
        EngineArgs(model=llama_dir, kv_cache_dtype="fp8", k_scale=0.0)
    with pytest.raises(ValueError, match=r"^v_scale must be a positive finite number, got -1\.0\.$"):
        EngineArgs.from_strings({"model": llama_dir, "v_scale": "-1"})
    args = EngineArgs.from_strings({"model": llama_dir, "kv_cache_dtype": "fp8_e4m3", "k_scale": "0.5"})
    assert (args.kv_cache_dtype, args.k_scale, args.v_scale) == ("fp8_e4m3", 0.5, 1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fp8_kv_cache_on_gpu_matches_the_cpu_engine(model_dir):
    """The GPU kernels (store, decode and prefill attention, in CUDA graphs) against the CPU
    references, both in float32 with the same FP8 cache: the same greedy tokens."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    common = dict(dtype="float32", kv_cache_dtype="fp8", k_scale=K_SCALE, v_scale=V_SCALE,
                  num_kv_blocks=256)
    gpu = LLM(model_dir, device="cuda", **common)
    assert gpu.engine.executor.worker.kv_cache.dtype == torch.float8_e4m3fn and gpu.engine.executor.runner.graphs
    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in LLM(model_dir, device="cpu", **common).generate(prompts, params)]
    assert got == want
