"""Gemma 2 and Gemma 3 (text) from transformers' own config classes, windows of 16 tokens, prompts
plus outputs several windows long: greedy tokens equal Hugging Face's (float32, CPU) under chunked
prefill, prefix caching and staggered arrivals. Soft-caps are set low (Gemma 2) so that they
shape the outputs; Gemma 3 mixes windowed layers (their own rope base) with a global one (linear
rope scaling)."""
from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy_generate
from test_sliding_window import _greedy_staggered, _window_prompts
from transformers import AutoModelForCausalLM

from tritium import EngineArgs, LLMEngine
from scripts.build_default_model import build_model

G3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
           "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
FAMILIES = {
    "gemma2": dict(arch="gemma2", num_hidden_layers=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3": dict(arch="gemma3", num_hidden_layers=4, rope_parameters=G3_ROPE,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def gemma(request, tmp_path_factory) -> tuple[str, str]:
    d = build_model(str(tmp_path_factory.mktemp(request.param)), seed=11, num_attention_heads=4,
                    num_key_value_heads=2, **FAMILIES[request.param])
    return request.param, d


def test_gemma_matches_hf_past_its_windows(gemma):
    family, d = gemma
    engine = LLMEngine(EngineArgs(model=d, dtype="float32"))
    c = engine.executor.worker.model.config
    assert engine.config.model_config.max_model_len == 2048  # windows cap nothing
    assert c.layer_windows == ((16, 0, 16, 0) if family == "gemma2" else (16, 0, 16, 16))
    assert c.scale_embeddings and c.hidden_act == "gelu_pytorch_tanh" and c.query_pre_attn_scalar == 24
    prompts = _window_prompts()
    # Eager attention: transformers' default (SDPA) drops Gemma 2's attention soft-cap.
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
    assert _greedy_staggered(d, prompts, 30) == hf_greedy_generate(hf, prompts, 30)


def test_gemma3_reads_the_older_config_layout(tmp_path):
    """Gemma 3 checkpoints made before transformers 5 give rope_theta, rope_local_base_freq,
    rope_scaling and sliding_window_pattern instead of per-layer-type entries."""
    from tritium.models import get_model_class
    config = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 64,
              "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 12, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh",
              "query_pre_attn_scalar": 16, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512,
              "sliding_window_pattern": 6, "final_logit_softcapping": None, "attn_logit_softcapping": None}
    c = get_model_class(config).read_config(config)
    assert c.layer_windows == (512,) * 5 + (0,) + (512,) * 5 + (0,)
    assert (c.rope_theta, c.local_rope_theta, c.rope_scaling) == (1e6, 1e4, {"rope_type": "linear", "factor": 8.0})


def test_gemma2_with_lora_speculation_swap_and_a_guided_request(tmp_path):
    """What serves other families serves Gemma 2: preemption by swap, n-gram speculation and a
    guided request give its greedy tokens; an attention and MLP LoRA adapter matches the merged
    model (eager attention for its soft-cap)."""
    from lora_adapters import merged_hf_model, write_adapter

    from tritium import LLM, SamplingParams
    d = build_model(str(tmp_path / "gemma2"), seed=11, num_attention_heads=4, num_key_value_heads=2,
                    **FAMILIES["gemma2"])
    prompts = _window_prompts()
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
    ref = hf_greedy_generate(hf, prompts, 30)
    params = SamplingParams(temperature=0, max_tokens=30, min_tokens=30)
    swap = LLM(d, dtype="float32", block_size=16, num_kv_blocks=12, max_num_batched_tokens=32,
               swap_space=0.01, preemption_mode="swap")
    assert [o.outputs[0].token_ids for o in swap.generate(prompts, params)] == ref
    assert swap.engine.get_stats().num_swapped_preemptions > 0
    spec = LLM(d, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                        "prompt_lookup_max": 3})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == ref
    guided = spec.generate(["Choose one:"], SamplingParams(temperature=0, max_tokens=10,
                                                            structured_outputs={"choice": ["yes", "no"]}))
    assert guided[0].outputs[0].text in ("yes", "no")
    adapter = write_adapter(str(tmp_path / "lora"), d, ["q_proj", "o_proj", "gate_proj", "down_proj"], 4, 8, seed=2)
    merged = merged_hf_model(d, adapter)
    merged.config._attn_implementation = "eager"
    lora_ref = hf_greedy_generate(merged, prompts[:2], 20)
    lora = LLM(d, dtype="float32", enable_lora=True, lora_modules={"a": adapter}, max_lora_rank=4)
    outs = lora.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=20, min_tokens=20), lora_request="a")
    assert [o.outputs[0].token_ids for o in outs] == lora_ref
